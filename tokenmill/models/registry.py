"""Architecture name (config.json `architectures[0]`) → model class, imported lazily."""

from __future__ import annotations

import importlib

from torch import nn

_MODELS = {
    "LlamaForCausalLM": ("tokenmill.models.llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("tokenmill.models.llama", "LlamaForCausalLM"),
    "Qwen2ForCausalLM": ("tokenmill.models.llama", "Qwen2ForCausalLM"),
    "Qwen3ForCausalLM": ("tokenmill.models.qwen3", "Qwen3ForCausalLM"),
}


def resolve_model_class(architecture: str) -> type[nn.Module]:
    if architecture not in _MODELS:
        raise ValueError(f"unsupported architecture {architecture!r}; "
                         f"supported: {', '.join(_MODELS)}")
    module, name = _MODELS[architecture]
    return getattr(importlib.import_module(module), name)
