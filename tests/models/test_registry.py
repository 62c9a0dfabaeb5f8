"""The architecture registry (models/registry.py): every entry's model class imports and is a
module, names are unique, and the lookups config.py and the GGUF loader make answer from it."""

from __future__ import annotations

import pytest
from torch import nn

from tokenmill.models import registry


def test_every_entry_resolves_and_names_are_unique():
    entries = list(registry.ARCHITECTURES.values())
    for a in entries:
        assert issubclass(a.model_class(), nn.Module)
    gguf = [a.gguf_name for a in entries if a.gguf_name]
    assert len({a.model_type for a in entries}) == len(entries)
    assert len(set(gguf)) == len(gguf)


def test_lookups():
    assert registry.find_architecture(["Foo", "Qwen2ForCausalLM"]).name == "Qwen2ForCausalLM"
    assert registry.find_architecture(["Foo"]) is None
    assert registry.gguf_architecture("llama").gguf_qk_permuted
    assert not registry.gguf_architecture("qwen3").gguf_qk_permuted
    assert registry.gguf_architecture("gpt2") is None
    assert registry.get_architecture("MistralForCausalLM").sliding_window_by_default
    with pytest.raises(ValueError, match="unsupported architecture 'Foo'; supported: Llama"):
        registry.resolve_model_class("Foo")
