"""Both grammar backends behind one interface, on SmolLM2's tokenizer: compile errors are
ValueErrors with the library's reason; a matcher's bitmask allows exactly the tokens it
accepts; validate does not move it, rollback undoes accept; forced tokens (jump-forward) are
accepted and decode to the forced text; a completed grammar terminates; JSON whitespace is
bounded and objects are closed unless the schema says otherwise."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from tokenmill.layers.token_bitmask import unpack_bitmask
from tokenmill.structured_output.backend import bitmask_width, json_schema_of
from tokenmill.structured_output.manager import make_backend
from tokenmill.structured_output.params import StructuredOutputsParams

V = 49152
BACKENDS = ["guidance", pytest.param("xgrammar", marks=pytest.mark.skipif(
    importlib.util.find_spec("xgrammar") is None, reason="xgrammar is an optional extra"))]


@pytest.fixture(scope="module")
def tokenizer(smollm2_path):
    from tokenmill.config_model import model_config
    from tokenmill.engine.tokenizer import load_tokenizer

    return load_tokenizer(model_config(smollm2_path))


@pytest.fixture(scope="module", params=BACKENDS)
def backend(request, tokenizer):
    return make_backend(request.param, tokenizer, V, [2])


def allowed(matcher) -> torch.Tensor:
    mask = torch.zeros(1, bitmask_width(V), dtype=torch.int32)
    matcher.fill_bitmask(mask, 0)
    return unpack_bitmask(mask, V)[0]


def test_bitmask_agrees_with_accept_and_rollback(backend, tokenizer):
    m = backend.compile(StructuredOutputsParams(regex=r"(cat|dog)s? [0-9]{2}")).matcher()
    ok = allowed(m)
    cat = tokenizer.encode("cat", add_special_tokens=False)
    assert bool(ok[cat[0]]) and not bool(ok[tokenizer.encode("x", add_special_tokens=False)[0]])
    assert m.validate(cat + tokenizer.encode("!", add_special_tokens=False)) == len(cat)
    assert torch.equal(allowed(m), ok)  # validate did not move it
    for t in cat:
        assert m.accept(t)
    after = allowed(m)
    m.rollback(len(cat))
    assert torch.equal(allowed(m), ok)
    for t in cat:
        m.accept(t)
    assert torch.equal(allowed(m), after)
    for t in tokenizer.encode("s 42", add_special_tokens=False):
        assert m.accept(t)
    assert m.is_terminated() and m.error() is None


def test_refused_token_is_a_dead_end(backend, tokenizer):
    m = backend.compile(StructuredOutputsParams(choice=["yes", "no"])).matcher()
    assert not m.accept(tokenizer.encode("maybe", add_special_tokens=False)[0])
    assert m.error()


def test_forced_tokens_decode_to_the_forced_text(backend, tokenizer):
    schema = {"type": "object", "properties": {"temperature_celsius": {"type": "number"}},
              "required": ["temperature_celsius"]}
    m = backend.compile(StructuredOutputsParams(json=schema)).matcher()
    forced = m.forced_tokens()
    assert forced and '{"temperature_celsius": '.startswith(tokenizer.decode(forced))
    assert len(tokenizer.decode(forced)) >= len('{"temperature')
    for t in forced:
        assert m.accept(t)


@pytest.mark.parametrize("params, message", [
    (StructuredOutputsParams(regex="[a-"), "regex"),
    (StructuredOutputsParams(json={"type": "strin"}), "json"),
    (StructuredOutputsParams(grammar="root ::= missing"), "grammar"),
])
def test_bad_constraints_raise_value_error(backend, params, message):
    with pytest.raises(ValueError, match=message):
        backend.compile(params)


def test_json_whitespace_is_bounded(backend, tokenizer):
    """No newline or run of spaces is allowed between JSON tokens (vLLM-CPU's default grammar
    let SmolLM2 emit newlines until max_tokens)."""
    m = backend.compile(StructuredOutputsParams(json={"type": "object", "properties": {
        "a": {"type": "integer"}}, "required": ["a"]})).matcher()
    for t in tokenizer.encode('{"a": 1', add_special_tokens=False):
        assert m.accept(t)
    ok = allowed(m)
    newline_tokens = [i for i in range(V) if "\n" in tokenizer.decode([i])][:200]
    assert not any(bool(ok[i]) for i in newline_tokens)


def test_objects_are_closed_unless_the_schema_opens_them():
    closed = json_schema_of(StructuredOutputsParams(json={"type": "object", "properties": {
        "a": {"type": "object", "properties": {}}, "b": {"enum": [{"type": "object"}]}}}))
    assert closed["additionalProperties"] is False
    assert closed["properties"]["a"]["additionalProperties"] is False
    assert closed["properties"]["b"] == {"enum": [{"type": "object"}]}  # values untouched
    opened = json_schema_of(StructuredOutputsParams(json={"type": "object",
                                                          "additionalProperties": True}))
    assert opened["additionalProperties"] is True
    forced = json_schema_of(StructuredOutputsParams(
        json={"type": "object", "additionalProperties": True},
        disable_additional_properties=True))
    assert forced["additionalProperties"] is False
    assert depth(json_schema_of(StructuredOutputsParams(json_object=True))) == 4


def depth(schema: dict) -> int:
    """Levels of objects and arrays a schema allows."""
    inner = [schema.get("additionalProperties"), schema.get("items"), *schema.get("anyOf", [])]
    below = max((depth(s) for s in inner if isinstance(s, dict)), default=0)
    return below + (schema.get("type") in ("object", "array"))


def test_json_object_values_nest_four_deep_at_most(backend, tokenizer):
    m = backend.compile(StructuredOutputsParams(json_object=True)).matcher()
    deep = '{"a": {"b": {"c": {"d": 1}}}}'
    assert m.validate(tokenizer.encode(deep, add_special_tokens=False)) == len(
        tokenizer.encode(deep, add_special_tokens=False))
    deeper = '{"a": {"b": {"c": {"d": {"e": 1}}}}}'
    ids = tokenizer.encode(deeper, add_special_tokens=False)
    assert m.validate(ids) < len(ids)


def test_unknown_backend_name(tokenizer):
    with pytest.raises(ValueError, match="unknown"):
        make_backend("outlines", tokenizer, V, [2])
