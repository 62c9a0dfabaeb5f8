"""The architecture registry (models/registry.py): every entry's model class imports and is a
module, names are unique, and the lookups config.py and the GGUF loader make answer from it;
a checkpoint of an unsupported architecture, RoPE type or activation fails at start-up with
an error naming it, never as a silently different model."""

from __future__ import annotations

import pytest
from torch import nn

from tokenmill.models import registry


def test_every_entry_resolves_and_names_are_unique():
    entries = list(registry.ARCHITECTURES.values())
    for a in entries:
        assert issubclass(a.model_class(), nn.Module)
    gguf = [(a.gguf_name, a.gguf_experts) for a in entries if a.gguf_name]
    assert len({a.model_type for a in entries}) == len(entries)
    assert len(set(gguf)) == len(gguf)  # llama.cpp's "llama" is Llama, or Mixtral with experts


def test_lookups():
    assert registry.find_architecture(["Foo", "Qwen2ForCausalLM"]).name == "Qwen2ForCausalLM"
    assert registry.find_architecture(["Foo"]) is None
    assert registry.gguf_architecture("llama").gguf_qk_permuted
    assert registry.gguf_architecture("llama", experts=True).name == "MixtralForCausalLM"
    assert registry.gguf_architecture("gemma2").gguf_norm_offset == 1.0
    assert not registry.gguf_architecture("qwen3").gguf_qk_permuted
    assert registry.gguf_architecture("gpt2") is None
    assert registry.get_architecture("Gemma3ForCausalLM").model_type == "gemma3_text"
    with pytest.raises(ValueError, match="unsupported architecture 'Foo'; supported: Llama"):
        registry.resolve_model_class("Foo")


def _edit_config(src: str, dst, **changes) -> str:
    import json
    import shutil

    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    config.update(changes)
    (dst / "config.json").write_text(json.dumps(config))
    return str(dst)


def test_unsupported_architecture_is_named(tiny_model, tmp_path):
    from tokenmill import LLM

    path = _edit_config(tiny_model("llama")[0], tmp_path / "m", architectures=["GPT2LMHeadModel"],
                        model_type="gpt2")
    with pytest.raises(ValueError, match="unsupported model architecture.*GPT2LMHeadModel"):
        LLM(path)


@pytest.mark.parametrize("changes, message", [
    (dict(rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}),
     "unsupported RoPE type 'dynamic'"),
    (dict(hidden_act="relu2"), "unsupported MLP activation 'relu2'"),
])
def test_unsupported_options_are_named(tiny_model, tmp_path, changes, message):
    from tokenmill import LLM

    path = _edit_config(tiny_model("llama")[0], tmp_path / "m", **changes)
    with pytest.raises(ValueError, match=message):
        LLM(path)


def test_unsupported_rope_type_of_one_layer_type_is_named(tiny_model, tmp_path):
    """Gemma 3 keys RoPE by layer type: each variant is checked."""
    from tokenmill import LLM

    rope = {"sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
            "full_attention": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e6}}
    path = _edit_config(tiny_model("gemma3")[0], tmp_path / "m", rope_parameters=rope)
    with pytest.raises(ValueError, match="unsupported RoPE type 'dynamic'"):
        LLM(path)
