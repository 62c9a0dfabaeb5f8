"""AWQ (GEMM) and GPTQ checkpoints written from a tiny model in the exact published layouts
(packing written here from the formats' definitions, independently of the loader): every
loaded layer equals the checkpoint's dequantized weights, and greedy output equals Hugging
Face's on those weights."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.conftest import assert_kv_all_free, hf_greedy
from tests.quantization.reference import hf_with_effective_weights
from tokenmill import LLM, SamplingParams
from tokenmill.layers import cpu_ops
from tokenmill.quantization.blocks import dequantize

pytestmark = pytest.mark.skipif(not cpu_ops.ops_available(), reason="C++ toolchain unavailable")

GROUP = 64
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def to_int32(words: torch.Tensor) -> torch.Tensor:
    """int64 words in [0, 2^32) → the int32 with the same bits."""
    return (((words + 2**31) % 2**32) - 2**31).to(torch.int32)


def rtn_zero_point(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """W (N, K) → q (K, N), z (K/G, N) in 0..15 and scales (K/G, N) float16, the checkpoints'
    w[k, n] = s (q - z) convention."""
    wt = w.t().contiguous()  # (K, N)
    K, N = wt.shape
    g = wt.view(K // GROUP, GROUP, N)
    lo, hi = g.amin(1), g.amax(1)
    s = ((hi - lo) / 15).clamp(min=1e-6).half()
    z = torch.round(-lo / s.float()).clamp(0, 15)
    q = torch.round(g / s.float().unsqueeze(1) + z.unsqueeze(1)).clamp(0, 15)
    return q.view(K, N).long(), z.long(), s


def pack_awq(values: torch.Tensor) -> torch.Tensor:
    """(R, N) → (R, N/8) int32: nibble i of word j holds column 8j + [0,2,4,6,1,3,5,7][i]."""
    order = [0, 2, 4, 6, 1, 3, 5, 7]
    v = values.view(values.shape[0], -1, 8)
    return to_int32(sum(v[:, :, order[i]] << (4 * i) for i in range(8)))


def pack_gptq_rows(values: torch.Tensor) -> torch.Tensor:
    """(K, N) → (K/8, N) int32: nibble j of word i holds row 8i + j."""
    v = values.view(-1, 8, values.shape[1])
    return to_int32(sum(v[:, j] << (4 * j) for j in range(8)))


def pack_gptq_cols(values: torch.Tensor) -> torch.Tensor:
    """(R, N) → (R, N/8) int32: nibble i of word j holds column 8j + i."""
    v = values.view(values.shape[0], -1, 8)
    return to_int32(sum(v[:, :, i] << (4 * i) for i in range(8)))


def write_checkpoint(src: str, out, method: str) -> dict[str, torch.Tensor]:
    """A copy of the tiny model at `src` with every decoder linear layer in `method`'s layout;
    returns each layer's dequantized weight (N, K) by checkpoint module name."""
    shutil.copytree(src, out)
    tensors = load_file(out / "model.safetensors")
    reference: dict[str, torch.Tensor] = {}
    for name in [n for n in tensors if n.endswith(".weight") and n.split(".")[-2] in LINEARS]:
        module = name[:-len(".weight")]
        q, z, s = rtn_zero_point(tensors.pop(name))
        reference[module] = ((q - z.repeat_interleave(GROUP, 0)) * s.float()
                             .repeat_interleave(GROUP, 0)).t()
        if method == "awq":
            tensors[f"{module}.qweight"] = pack_awq(q)
            tensors[f"{module}.qzeros"] = pack_awq(z)
        else:
            tensors[f"{module}.qweight"] = pack_gptq_rows(q)
            tensors[f"{module}.qzeros"] = pack_gptq_cols(z - 1)  # "gptq": stored minus one
            tensors[f"{module}.g_idx"] = torch.arange(q.shape[0], dtype=torch.int32) // GROUP
        tensors[f"{module}.scales"] = s
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"] = (
        {"quant_method": "awq", "bits": 4, "group_size": GROUP, "zero_point": True,
         "version": "gemm"} if method == "awq" else
        {"quant_method": "gptq", "bits": 4, "group_size": GROUP, "desc_act": False,
         "sym": False, "checkpoint_format": "gptq"})
    (out / "config.json").write_text(json.dumps(config))
    return reference


@pytest.mark.parametrize("method", ["awq", "gptq"])
def test_checkpoint_loads_to_its_dequantized_weights(method, tiny_model, tmp_path):
    src, shared = tiny_model("qwen2")  # q/k/v biases, an untied head: every part of a layer
    ref = write_checkpoint(src, tmp_path / method, method)
    llm = LLM(str(tmp_path / method))  # the format comes from config.json
    assert llm.engine.config.model.quantization == method
    layers = llm.engine.runner.model.model.layers
    for i, layer in enumerate(layers):
        parts = {"self_attn.qkv_proj": ["self_attn.q_proj", "self_attn.k_proj",
                                        "self_attn.v_proj"],
                 "self_attn.o_proj": ["self_attn.o_proj"],
                 "mlp.gate_up_proj": ["mlp.gate_proj", "mlp.up_proj"],
                 "mlp.down_proj": ["mlp.down_proj"]}
        for ours, theirs in parts.items():
            lin = layer.get_submodule(ours)
            assert not hasattr(lin, "weight")  # no float copy kept
            loaded = dequantize(lin.quant_method.cpu_kernel(lin))
            expected = torch.cat([ref[f"model.layers.{i}.{t}"] for t in theirs])
            # m = -z s is rounded to float16: at most 15 s 2^-11, under 1% of a step s.
            step = expected.abs().max() / 15
            torch.testing.assert_close(loaded, expected, atol=1e-2 * step, rtol=0)
    # Greedy output equals HF's forward on the weights tokenmill loaded.
    hf = hf_with_effective_weights(shared, llm.engine.runner.model)
    prompts = [[5, 900, 31, 7, 4000], list(range(100, 140))]
    expected = [hf_greedy(hf, p, 12) for p in prompts]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                        use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert_kv_all_free(llm.engine)


def test_bad_checkpoints_fail_at_start_up(tiny_model, tmp_path):
    src, _ = tiny_model("llama")
    write_checkpoint(src, tmp_path / "g", "gptq")
    tensors = load_file(tmp_path / "g" / "model.safetensors")
    name = "model.layers.0.mlp.down_proj.g_idx"  # 128 inputs: two groups
    tensors[name] = tensors[name].flip(0).contiguous()  # act-order: groups out of order
    save_file(tensors, tmp_path / "g" / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="desc_act"):
        LLM(str(tmp_path / "g"))
    tensors[name] = tensors[name].flip(0).contiguous()
    tensors["model.layers.0.self_attn.q_proj.g_idx"][0] = 1  # q's groups differ from k's
    save_file(tensors, tmp_path / "g" / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="disagree"):
        LLM(str(tmp_path / "g"))
    with pytest.raises(ValueError, match="gptq checkpoint"):
        LLM(str(tmp_path / "g"), quantization="awq")
    with pytest.raises(ValueError, match="needs a checkpoint in that format"):
        LLM(src, quantization="gptq")
    config = json.loads((tmp_path / "g" / "config.json").read_text())
    config["quantization_config"]["bits"] = 8
    (tmp_path / "g" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="8 bits"):
        LLM(str(tmp_path / "g"))
