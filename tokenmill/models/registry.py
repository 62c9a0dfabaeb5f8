"""The architecture registry: one entry per architecture owns what the rest of the engine asks
about it (issue 21's design): the model class (imported lazily), the Hugging Face model_type,
the llama.cpp GGUF architecture name, its GGUF tensor names where they differ from Llama's,
how its GGUF metadata becomes a transformers config, and whether llama.cpp's converter permuted
the q/k rows or stored norm weights plus one. `config.py` asks it which checkpoints
load, `model_loader/gguf_loader.py` which GGUF files do; adding a Llama-like architecture is
one entry here and one model file.

Invariant: names and HF names are unique across entries, and so are (GGUF name, whether the file
holds experts): llama.cpp stores Mixtral as "llama" with expert tensors.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import nn


@dataclass(frozen=True)
class Architecture:
    name: str  # config.json `architectures[0]`
    module: str  # where the model class lives
    class_name: str
    model_type: str  # transformers' model_type (its config class)
    gguf_name: str | None = None  # llama.cpp's `general.architecture`; None: no GGUF support
    gguf_qk_permuted: bool = False  # llama.cpp's converter interleaved the q/k rows (Llama)
    gguf_experts: bool = False  # this entry reads the GGUF files of `gguf_name` with experts
    # llama.cpp tensor name (without "blk.N." and ".weight") → our checkpoint name, where it
    # differs from model_loader/gguf_loader.py's Llama table ("{e}": one tensor per expert)
    gguf_tensors: tuple[tuple[str, str], ...] = ()
    gguf_norm_offset: float = 0.0  # llama.cpp stored RMSNorm weights + this (Gemma: 1)
    # a function of the model's module: (GGUF metadata getter, tensor names) → config kwargs
    gguf_config: str | None = None

    def model_class(self) -> type[nn.Module]:
        return getattr(importlib.import_module(self.module), self.class_name)

    def gguf_config_kwargs(self, meta: Callable[..., Any], tensor: Callable[[str], Any],
                           names: set[str]) -> dict[str, Any]:
        """This architecture's transformers config fields from its GGUF file (`meta(key,
        default)` reads metadata `{gguf_name}.{key}`, `tensor(name)` a tensor as a float32
        array or None, `names` the file's tensor names), beyond what every GGUF has."""
        if self.gguf_config is None:
            return {}
        fn = getattr(importlib.import_module(self.module), self.gguf_config)
        return fn(meta, tensor, names)


_LLAMA = "tokenmill.models.llama"
_MIXTRAL_GGUF = (("ffn_gate_inp", "block_sparse_moe.gate"),
                 ("ffn_gate_exps", "block_sparse_moe.experts.{e}.w1"),
                 ("ffn_up_exps", "block_sparse_moe.experts.{e}.w3"),
                 ("ffn_down_exps", "block_sparse_moe.experts.{e}.w2"))
# Gemma's four norms per layer
_GEMMA_GGUF = (("attn_post_norm", "post_attention_layernorm"),
               ("ffn_norm", "pre_feedforward_layernorm"),
               ("post_ffw_norm", "post_feedforward_layernorm"))
ARCHITECTURES: dict[str, Architecture] = {a.name: a for a in (
    Architecture("LlamaForCausalLM", _LLAMA, "LlamaForCausalLM", "llama", gguf_name="llama",
                 gguf_qk_permuted=True),
    Architecture("MistralForCausalLM", _LLAMA, "LlamaForCausalLM", "mistral"),
    Architecture("MixtralForCausalLM", "tokenmill.models.mixtral", "MixtralForCausalLM",
                 "mixtral", gguf_name="llama", gguf_qk_permuted=True, gguf_experts=True,
                 gguf_tensors=_MIXTRAL_GGUF, gguf_config="gguf_config"),
    Architecture("Qwen2ForCausalLM", _LLAMA, "Qwen2ForCausalLM", "qwen2", gguf_name="qwen2"),
    Architecture("Qwen3ForCausalLM", "tokenmill.models.qwen3", "Qwen3ForCausalLM", "qwen3",
                 gguf_name="qwen3"),
    Architecture("Qwen2MoeForCausalLM", "tokenmill.models.qwen_moe", "Qwen2MoeForCausalLM",
                 "qwen2_moe", gguf_name="qwen2moe", gguf_experts=True,
                 gguf_config="gguf_config_qwen2moe"),
    Architecture("Qwen3MoeForCausalLM", "tokenmill.models.qwen_moe", "Qwen3MoeForCausalLM",
                 "qwen3_moe", gguf_name="qwen3moe", gguf_experts=True,
                 gguf_config="gguf_config_qwen3moe"),
    Architecture("OlmoeForCausalLM", "tokenmill.models.olmoe", "OlmoeForCausalLM", "olmoe",
                 gguf_name="olmoe", gguf_experts=True, gguf_config="gguf_config"),
    Architecture("Phi3ForCausalLM", "tokenmill.models.phi3", "Phi3ForCausalLM", "phi3",
                 gguf_name="phi3", gguf_config="gguf_config",
                 gguf_tensors=(("attn_qkv", "self_attn.qkv_proj"),
                               ("ffn_up", "mlp.gate_up_proj"))),
    Architecture("GraniteForCausalLM", "tokenmill.models.granite", "GraniteForCausalLM",
                 "granite", gguf_name="granite", gguf_qk_permuted=True,
                 gguf_config="gguf_config"),
    Architecture("Gemma2ForCausalLM", "tokenmill.models.gemma", "Gemma2ForCausalLM", "gemma2",
                 gguf_name="gemma2", gguf_tensors=_GEMMA_GGUF, gguf_norm_offset=1.0,
                 gguf_config="gguf_config_gemma2"),
    Architecture("Gemma3ForCausalLM", "tokenmill.models.gemma", "Gemma3ForCausalLM",
                 "gemma3_text", gguf_name="gemma3", gguf_tensors=_GEMMA_GGUF,
                 gguf_norm_offset=1.0, gguf_config="gguf_config_gemma3"),
)}


def supported() -> str:
    return ", ".join([*ARCHITECTURES, *(f"{n} (embeddings)" for n in HEADLESS)])


def get_architecture(name: str) -> Architecture:
    if name not in ARCHITECTURES:
        raise ValueError(f"unsupported architecture {name!r}; supported: {supported()}")
    return ARCHITECTURES[name]


# Base-model checkpoints (transformers' `*Model`: the decoder stack without its LM head, as
# embedding models such as e5-mistral or gte-Qwen2 ship it) → the causal LM serving them, for
# embeddings only; their tensor names lack the "model." prefix.
HEADLESS = {"LlamaModel": "LlamaForCausalLM", "MistralModel": "MistralForCausalLM",
            "Qwen2Model": "Qwen2ForCausalLM", "Qwen3Model": "Qwen3ForCausalLM",
            "Gemma2Model": "Gemma2ForCausalLM"}


def find_architecture(names: list[str]) -> Architecture | None:
    """The first of a config's `architectures` that is registered (a base model's name: its
    causal LM's entry)."""
    names = [HEADLESS.get(n, n) for n in names]
    return next((ARCHITECTURES[n] for n in names if n in ARCHITECTURES), None)


def is_headless(names: list[str]) -> bool:
    """Whether the config names a base model (no LM head) before any causal LM."""
    known = [n for n in names if n in HEADLESS or n in ARCHITECTURES]
    return bool(known) and known[0] in HEADLESS


def gguf_architecture(gguf_name: str, experts: bool = False) -> Architecture | None:
    """The entry reading GGUF files of llama.cpp's `gguf_name`, with or without experts."""
    return next((a for a in ARCHITECTURES.values()
                 if a.gguf_name == gguf_name and a.gguf_experts == experts), None)


def gguf_names() -> str:
    return ", ".join(sorted({a.gguf_name for a in ARCHITECTURES.values() if a.gguf_name}))


def resolve_model_class(architecture: str) -> type[nn.Module]:
    return get_architecture(architecture).model_class()
