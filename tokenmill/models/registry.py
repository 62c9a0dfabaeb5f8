"""The architecture registry: one entry per architecture owns what the rest of the engine asks
about it (issue 21's design): the model class (imported lazily), the Hugging Face model_type,
the llama.cpp GGUF architecture name and whether its converter permuted the q/k rows, and
which options it has (a sliding window on by default). `config.py` asks it which checkpoints
load, `model_loader/gguf_loader.py` which GGUF files do; adding a Llama-like architecture is
one entry here and one model file.

Invariant: names, HF names and GGUF names are each unique across entries.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

from torch import nn


@dataclass(frozen=True)
class Architecture:
    name: str  # config.json `architectures[0]`
    module: str  # where the model class lives
    class_name: str
    model_type: str  # transformers' model_type (its config class)
    gguf_name: str | None = None  # llama.cpp's `general.architecture`; None: no GGUF support
    gguf_qk_permuted: bool = False  # llama.cpp's converter interleaved the q/k rows (Llama)
    sliding_window_by_default: bool = False  # `use_sliding_window` when the config omits it

    def model_class(self) -> type[nn.Module]:
        return getattr(importlib.import_module(self.module), self.class_name)


_LLAMA = "tokenmill.models.llama"
ARCHITECTURES: dict[str, Architecture] = {a.name: a for a in (
    Architecture("LlamaForCausalLM", _LLAMA, "LlamaForCausalLM", "llama", gguf_name="llama",
                 gguf_qk_permuted=True),
    Architecture("MistralForCausalLM", _LLAMA, "LlamaForCausalLM", "mistral",
                 sliding_window_by_default=True),
    Architecture("MixtralForCausalLM", "tokenmill.models.mixtral", "MixtralForCausalLM",
                 "mixtral", sliding_window_by_default=True),
    Architecture("Qwen2ForCausalLM", _LLAMA, "Qwen2ForCausalLM", "qwen2", gguf_name="qwen2"),
    Architecture("Qwen3ForCausalLM", "tokenmill.models.qwen3", "Qwen3ForCausalLM", "qwen3",
                 gguf_name="qwen3"),
)}


def supported() -> str:
    return ", ".join(ARCHITECTURES)


def get_architecture(name: str) -> Architecture:
    if name not in ARCHITECTURES:
        raise ValueError(f"unsupported architecture {name!r}; supported: {supported()}")
    return ARCHITECTURES[name]


def find_architecture(names: list[str]) -> Architecture | None:
    """The first of a config's `architectures` that is registered."""
    return next((ARCHITECTURES[n] for n in names if n in ARCHITECTURES), None)


def gguf_architecture(gguf_name: str) -> Architecture | None:
    return next((a for a in ARCHITECTURES.values() if a.gguf_name == gguf_name), None)


def gguf_names() -> str:
    return ", ".join(a.gguf_name for a in ARCHITECTURES.values() if a.gguf_name)


def resolve_model_class(architecture: str) -> type[nn.Module]:
    return get_architecture(architecture).model_class()
