"""GGUF files written as llama.cpp's converter writes them, from the tiny random-weight HF
models of tests/conftest.py: its tensor names, stacked experts, Llama's q/k row interleave,
Gemma's norm weights + 1, Phi-3's longrope factor tensors, the architecture's metadata and
SmolLM2's tokenizer; weights in float32, or their matrices in a GGML block type (quantized by
the gguf package, as llama.cpp's quantizer would)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from safetensors.torch import load_file

from tokenmill.bench.real_gguf import random_blocks
from tokenmill.model_loader.gguf_loader import _GLOBAL_NAMES, _LAYER_NAMES, gguf_reader
from tokenmill.models import registry

# kind → (llama.cpp architecture, HF architecture the file must load as)
KINDS = {"llama": ("llama", "LlamaForCausalLM"),
         "mixtral": ("llama", "MixtralForCausalLM"),
         "qwen2_moe": ("qwen2moe", "Qwen2MoeForCausalLM"),
         "qwen3_moe": ("qwen3moe", "Qwen3MoeForCausalLM"),
         "gemma2": ("gemma2", "Gemma2ForCausalLM"),
         "gemma3-6": ("gemma3", "Gemma3ForCausalLM"),
         "phi3": ("phi3", "Phi3ForCausalLM"),
         "olmoe": ("olmoe", "OlmoeForCausalLM"),
         "granite": ("granite", "GraniteForCausalLM")}


def _permute_qk(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter: (heads, 2, D/2) → (heads, D/2, 2) rows (the loader undoes it)."""
    return (w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def _metadata(arch: str, c) -> dict[str, tuple[object, str]]:
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    m = {"context_length": (c.max_position_embeddings, "u32"),
         "embedding_length": (c.hidden_size, "u32"),
         "feed_forward_length": (c.intermediate_size, "u32"),
         "block_count": (c.num_hidden_layers, "u32"),
         "attention.head_count": (c.num_attention_heads, "u32"),
         "attention.head_count_kv": (c.num_key_value_heads, "u32"),
         "attention.key_length": (head_dim, "u32"),
         "attention.layer_norm_rms_epsilon": (c.rms_norm_eps, "f32"),
         "rope.freq_base": (float(c.rope_parameters.get("rope_theta", 1e4)), "f32"),  # (one)
         "vocab_size": (c.vocab_size, "u32")}
    experts = getattr(c, "num_local_experts", None) or getattr(c, "num_experts", None)
    if experts:
        m["expert_count"] = (experts, "u32")
        m["expert_used_count"] = (c.num_experts_per_tok, "u32")
    if getattr(c, "moe_intermediate_size", None):
        m["expert_feed_forward_length"] = (c.moe_intermediate_size, "u32")
    if getattr(c, "shared_expert_intermediate_size", None):
        m["expert_shared_feed_forward_length"] = (c.shared_expert_intermediate_size, "u32")
    if arch == "gemma3":
        m["attention.sliding_window"] = (c.sliding_window, "u32")
        m["rope.freq_base"] = (float(c.rope_parameters["full_attention"]["rope_theta"]), "f32")
    if arch == "gemma2":
        m["attn_logit_softcapping"] = (c.attn_logit_softcapping, "f32")
        m["final_logit_softcapping"] = (c.final_logit_softcapping, "f32")
        m["attention.sliding_window"] = (c.sliding_window, "u32")
    if getattr(c, "clip_qkv", None) is not None:
        m["attention.clamp_kqv"] = (c.clip_qkv, "f32")
    if arch == "granite":  # the converter's names for the four multipliers
        m["embedding_scale"] = (c.embedding_multiplier, "f32")
        m["residual_scale"] = (c.residual_multiplier, "f32")
        m["attention.scale"] = (c.attention_multiplier, "f32")
        m["logit_scale"] = (c.logits_scaling, "f32")
    if arch == "phi3":
        m["rope.dimension_count"] = (head_dim, "u32")
        m["rope.scaling.original_context_length"] = (c.original_max_position_embeddings, "u32")
    return m


def _block_tensor(writer, name: str, data: np.ndarray,
                  block_type: str | dict[str, str] | None) -> None:
    """A matrix in the GGML block type (token_embd in Q8_0, as llama.cpp's quantizer keeps
    it finer), anything else as float32. A dict names a type per tensor ("attn_v",
    "token_embd", stacked experts "ffn_gate_exps"): the gguf package quantizes Q4_0 / Q4_1 /
    Q8_0 / Q5_0 / Q5_1 from the weights; K-quants are random blocks (random_blocks)."""
    import gguf

    if isinstance(block_type, dict):
        parts = name.split(".")
        block_type = block_type.get(parts[2] if parts[0] == "blk" else parts[0])
    elif block_type is not None and name.startswith("token_embd"):
        block_type = "Q8_0"
    if block_type is None or data.ndim != 2 or data.shape[1] % 32:
        writer.add_tensor(name, data)
        return
    writer.add_tensor(name, _raw_blocks(name, data, block_type),
                      raw_dtype=gguf.GGMLQuantizationType[block_type])


def _raw_blocks(name: str, data: np.ndarray, block_type: str, seed: int = 0) -> np.ndarray:
    """A matrix as raw blocks of `block_type`: quantized by the gguf package, or random blocks
    for the K-quants and IQ4 types (which it cannot quantize)."""
    import gguf
    from gguf import quants

    if block_type.endswith("_K") or block_type.startswith("IQ"):
        return random_blocks(block_type, *data.shape, seed=len(name) + data.shape[0] + seed)
    return quants.quantize(data, gguf.GGMLQuantizationType[block_type])


def write_gguf(kind: str, folder: str, hf, smollm2_path: str, out: Path,
               block_type: str | dict[str, str] | None = None) -> None:
    """block_type: "Q4_0", "Q4_1" or "Q8_0" for the matrices, or a type per tensor name
    (_block_tensor); None: float32."""
    import gguf

    arch, hf_arch = KINDS[kind]
    spec = registry.get_architecture(hf_arch)
    c = hf.config
    writer = gguf.GGUFWriter(str(out), arch)
    for key, (value, kind_) in _metadata(arch, c).items():
        {"u32": writer.add_uint32, "f32": writer.add_float32}[kind_](f"{arch}.{key}", value)
    for name, field in gguf_reader(smollm2_path).fields.items():  # SmolLM2's tokenizer
        if name.startswith("tokenizer."):
            sub = field.types[1] if len(field.types) > 1 else None
            writer.add_key_value(name, field.contents(), field.types[0], sub)
    to_gguf = {hf_name: g for g, hf_name in (_LAYER_NAMES | dict(spec.gguf_tensors)).items()}
    experts: dict[str, list[tuple[int, np.ndarray]]] = {}
    for name, tensor in load_file(f"{folder}/model.safetensors").items():
        data = tensor.float().numpy()
        if spec.gguf_norm_offset and name.endswith("norm.weight"):
            data = data + spec.gguf_norm_offset  # every norm, the final one too
        if name in {v: k for k, v in _GLOBAL_NAMES.items()}:
            _block_tensor(writer, {v: k for k, v in _GLOBAL_NAMES.items()}[name], data,
                          block_type)
            continue
        layer, rest = name.removeprefix("model.layers.").split(".", 1)
        module, what = rest.rsplit(".", 1)  # what: weight | bias
        expert = None
        for hf_name in to_gguf:
            if "{e}" in hf_name:
                prefix, suffix = hf_name.split("{e}")
                if module.startswith(prefix) and module.endswith(suffix):
                    expert = int(module[len(prefix):-len(suffix)])
                    module = hf_name
        g = to_gguf[module]
        if spec.gguf_qk_permuted and g in ("attn_q", "attn_k"):
            data = _permute_qk(data, c.num_attention_heads if g == "attn_q"
                               else c.num_key_value_heads)
        if g == "ffn_gate_inp_shexp":
            data = data.reshape(-1)
        if expert is not None:
            experts.setdefault(f"blk.{layer}.{g}.{what}", []).append((expert, data))
        else:
            _block_tensor(writer, f"blk.{layer}.{g}.{what}", data, block_type)
    for name, parts in experts.items():  # stacked (E, rows, cols), as llama.cpp stores them
        ordered = [d for _, d in sorted(parts, key=lambda p: p[0])]
        expert_type = block_type.get(name.split(".")[2]) if isinstance(block_type, dict) \
            else None  # ("ffn_gate_exps": a type of their own, else float32)
        if expert_type is None:
            writer.add_tensor(name, np.stack(ordered))
        else:
            raw = np.stack([_raw_blocks(name, d, expert_type, e) for e, d in enumerate(ordered)])
            writer.add_tensor(name, raw, raw_dtype=gguf.GGMLQuantizationType[expert_type])
    rope = c.rope_parameters
    if rope.get("rope_type") == "longrope":
        writer.add_tensor("rope_factors_long.weight", np.array(rope["long_factor"], np.float32))
        writer.add_tensor("rope_factors_short.weight", np.array(rope["short_factor"],
                                                                np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


