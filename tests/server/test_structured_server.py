"""Structured outputs behind the OpenAI server, with the official client, on SmolLM2: JSON
schemas of every common shape give answers that parse and validate; json_object, regex,
choice and grammar answers match; vLLM's `structured_outputs` and `guided_*` fields work;
streamed and whole answers are equal at temperature 0; bad constraints are a 400 before
anything is scheduled."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator

import jsonschema
import openai
import pytest

from tests.server.conftest import RunningServer, start_server
from tests.server.test_spec_decode_server import metric
from tokenmill.engine.llm_engine import LLMEngine

SCHEMAS = {
    "person": ("Describe a fictional person.", {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 40},
                       "age": {"type": "integer", "minimum": 0, "maximum": 120},
                       "email": {"type": "string", "pattern": "^[a-z]{1,12}@[a-z]{1,12}\\.com$"}},
        "required": ["name", "age", "email"]}),
    "nested": ("Describe a city and its mayor.", {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 30},
                       "mayor": {"type": "object",
                                 "properties": {"name": {"type": "string", "maxLength": 30},
                                                "party": {"enum": ["red", "blue", "green"]}},
                                 "required": ["name", "party"]},
                       "population": {"type": "number", "minimum": 1000}},
        "required": ["city", "mayor", "population"]}),
    "array": ("List three fruits with their colours.", {
        "type": "object",
        "properties": {"fruits": {"type": "array", "minItems": 1, "maxItems": 3,
                                  "items": {"type": "object",
                                            "properties": {"fruit": {"type": "string",
                                                                     "maxLength": 20},
                                                           "colour": {"type": "string",
                                                                      "maxLength": 20}},
                                            "required": ["fruit", "colour"]}}},
        "required": ["fruits"]}),
    "enum_bool": ("Is the sky blue? Answer with a verdict and your confidence.", {
        "type": "object",
        "properties": {"verdict": {"enum": ["yes", "no", "unsure"]},
                       "confident": {"type": "boolean"},
                       "score": {"type": "number", "minimum": 0, "maximum": 1}},
        "required": ["verdict", "confident", "score"], "additionalProperties": False}),
    "unbounded": ("Give a product name and price.", {
        "type": "object",
        "properties": {"product": {"type": "string"}, "price": {"type": "number"}},
        "required": ["product", "price"]}),
}


@pytest.fixture(scope="module")
def server(smollm2_path) -> Iterator[RunningServer]:
    engine = LLMEngine.from_options(smollm2_path, kv_cache_memory="256MiB")
    yield from start_server(engine, "smollm2")


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0)


def chat(client: openai.OpenAI, text: str, **kwargs):
    return client.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": text}], temperature=0,
        max_tokens=kwargs.pop("max_tokens", 160), **kwargs)


@pytest.mark.parametrize("name", list(SCHEMAS))
def test_json_schema_answers_parse_and_validate(client, server, name):
    prompt, schema = SCHEMAS[name]
    fmt = {"type": "json_schema", "json_schema": {"name": name, "schema": schema}}
    r = chat(client, prompt, response_format=fmt)
    choice = r.choices[0]
    assert choice.finish_reason == "stop", choice.message.content
    jsonschema.validate(json.loads(choice.message.content), schema)
    streamed = chat(client, prompt, response_format=fmt, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
    assert text == choice.message.content
    server.wait_idle()
    assert metric(server.base_url, "structured_output_jump_forward_tokens_total") > 0


def test_json_object_answer_is_an_object(client):
    r = chat(client, "Describe the weather today as JSON.",
             response_format={"type": "json_object"}, max_tokens=200)
    assert r.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(r.choices[0].message.content), dict)


def test_regex_choice_and_grammar_through_vllm_fields(client):
    r = chat(client, "Give me a US phone number.",
             extra_body={"structured_outputs": {"regex": r"\(\d{3}\) \d{3}-\d{4}"}})
    assert re.fullmatch(r"\([0-9]{3}\) [0-9]{3}-[0-9]{4}", r.choices[0].message.content)
    r = chat(client, "What is the capital of France?",
             extra_body={"guided_choice": ["Paris", "London", "Rome"]})
    assert r.choices[0].message.content in ("Paris", "London", "Rome")
    r = chat(client, "Is water wet?", extra_body={"guided_grammar": 'root ::= "yes" | "no"'})
    assert r.choices[0].message.content in ("yes", "no")
    r = client.completions.create(model="smollm2", prompt="A JSON list of two numbers:",
                                  max_tokens=60, temperature=0,
                                  extra_body={"guided_json": {"type": "array", "minItems": 2,
                                                              "maxItems": 2,
                                                              "items": {"type": "integer"}}})
    value = json.loads(r.choices[0].text)
    assert len(value) == 2 and all(isinstance(v, int) for v in value)
    schema = {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}
    r = client.completions.create(
        model="smollm2", prompt="A point as JSON:", max_tokens=30, temperature=0,
        extra_body={"response_format": {"type": "json_schema",
                                        "json_schema": {"name": "p", "schema": schema}}})
    jsonschema.validate(json.loads(r.choices[0].text), schema)  # response_format, completions


@pytest.mark.parametrize("body, message", [
    ({"response_format": {"type": "json_schema",
                          "json_schema": {"name": "x", "schema": {"type": "strin"}}}}, "strin"),
    ({"structured_outputs": {"regex": "[a-"}}, "regex"),
    ({"guided_choice": []}, "choice"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "only allowed once"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "only allowed once"),
    ({"response_format": {"type": "json_schema"}}, "json_schema"),
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"structured_outputs": {"json_object": True, "structural_tag": "x"}}, "structural_tag"),
    ({"structured_outputs": {"jsonn": {}}}, "jsonn"),
])
def test_bad_constraints_are_400(client, server, body, message):
    with pytest.raises(openai.BadRequestError, match=message):
        chat(client, "hi", extra_body=body)
    server.wait_idle()
