"""StructuredOutputsParams and StructuredOutputsConfig: vLLM's names, exactly one constraint,
clear errors naming the field, and a canonical spec so equal constraints share a grammar."""

from __future__ import annotations

import pytest

from tokenmill import SamplingParams, StructuredOutputsParams
from tokenmill.structured_output import StructuredOutputsConfig


def test_kinds_and_canonical_spec():
    a = StructuredOutputsParams(json='{"type": "object", "properties": {"a": {"type": "x"}}}')
    b = StructuredOutputsParams(json={"properties": {"a": {"type": "x"}}, "type": "object"})
    assert a.kind == b.kind == "json" and a.spec == b.spec
    assert StructuredOutputsParams(json_object=True).kind == "json_object"
    assert StructuredOutputsParams(choice=("a", "b")).choice == ["a", "b"]
    assert StructuredOutputsParams(regex="a+").spec != StructuredOutputsParams(regex="a*").spec
    ws = StructuredOutputsParams(json={"type": "object"}, disable_any_whitespace=True)
    assert ws.spec != StructuredOutputsParams(json={"type": "object"}).spec
    assert SamplingParams(structured_outputs={"regex": "a"}).structured_outputs.kind == "regex"


@pytest.mark.parametrize("kwargs, message", [
    ({}, "exactly one"),
    ({"regex": "a", "choice": ["a"]}, "exactly one"),
    ({"json": "{not json"}, "JSON schema"),
    ({"json": [1, 2]}, "JSON schema"),
    ({"regex": ""}, "regex"),
    ({"choice": []}, "choice"),
    ({"choice": ["a", ""]}, "choice"),
    ({"choice": "ab"}, "choice"),
    ({"grammar": 3}, "grammar"),
    ({"json_object": True, "structural_tag": "x"}, "structural_tag"),
    ({"json": {}, "disable_any_whitespace": True, "whitespace_pattern": " "}, "contradict"),
])
def test_bad_params_name_the_problem(kwargs, message):
    with pytest.raises(ValueError, match=message):
        StructuredOutputsParams(**kwargs)


def test_sampling_params_refuse_unknown_fields_and_types():
    with pytest.raises(ValueError, match="jsn"):
        SamplingParams(structured_outputs={"jsn": {}})
    with pytest.raises(ValueError, match="StructuredOutputsParams"):
        SamplingParams(structured_outputs="json")


def test_engine_config():
    assert StructuredOutputsConfig.parse(None) == StructuredOutputsConfig("auto", True)
    assert StructuredOutputsConfig.parse('{"backend": "xgrammar", "jump_forward": false}') == \
        StructuredOutputsConfig("xgrammar", False)
    for bad, message in [('{"backend": "outlines"}', "backend"), ('{"jf": 1}', "unknown"),
                         ("[1]", "object"), ("{", "JSON"), ({"jump_forward": 1}, "true")]:
        with pytest.raises(ValueError, match=message):
            StructuredOutputsConfig.parse(bad)
