"""OpenAI's Responses API with the official `openai` client: answers (text, streamed or not,
function calls, a conversation with function call outputs, a JSON schema) equal the same
conversation through chat completions at temperature 0; the typed stream events assemble to
the same response; store, previous_response_id, other tool types and unknown fields are
refused by name."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

from tests.server.conftest import start_server
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.server.tools import ToolOptions

WEATHER = {"type": "function", "name": "get_weather", "description": "Current weather.",
           "parameters": {"type": "object",
                          "properties": {"city": {"type": "string", "maxLength": 12}},
                          "required": ["city"]}}
CHAT_WEATHER = {"type": "function", "function": {k: WEATHER[k] for k in
                                                 ("name", "description", "parameters")}}
ASK = "What is the weather in Paris?"
SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
          "additionalProperties": False}


@pytest.fixture(scope="module")
def server(tiny_model):
    path, _ = tiny_model("llama")
    engine = LLMEngine.from_options(path, max_model_len=512, num_kv_blocks=300)
    yield from start_server(engine, "tiny-llama", tool_options=ToolOptions(True, "hermes"))


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0)


def chat(client: openai.OpenAI, messages: list[dict], **kwargs):
    return client.chat.completions.create(model="tiny-llama", temperature=0,
                                          messages=messages, **kwargs)


def test_text_equals_chat_completions(client):
    r = client.responses.create(model="tiny-llama", instructions="Be brief.", input=ASK,
                                max_output_tokens=12, temperature=0)
    c = chat(client, [{"role": "system", "content": "Be brief."},
                      {"role": "user", "content": ASK}], max_tokens=12)
    assert r.object == "response" and r.model == "tiny-llama"
    assert r.output_text == c.choices[0].message.content
    assert r.usage.input_tokens == c.usage.prompt_tokens
    assert r.usage.output_tokens == c.usage.completion_tokens
    assert r.status == ("incomplete" if c.choices[0].finish_reason == "length" else "completed")


def test_stream_events_assemble_to_the_response(client):
    kwargs = dict(model="tiny-llama", input=[{"role": "user", "content": [
        {"type": "input_text", "text": ASK}]}], max_output_tokens=12, temperature=0)
    whole = client.responses.create(**kwargs)
    events = list(client.responses.create(stream=True, **kwargs))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.completed"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text == events[-1].response.output_text
    streamed = events[-1].response.usage  # counted from the stream's deltas
    assert (streamed.input_tokens, streamed.output_tokens, streamed.total_tokens) == (
        whole.usage.input_tokens, whole.usage.output_tokens, whole.usage.total_tokens)
    # the same prompt again: its full blocks come from the prefix cache, and usage says so
    cached = streamed.input_tokens_details.cached_tokens
    assert 0 < cached < streamed.input_tokens and cached % 16 == 0
    with client.responses.stream(**kwargs) as stream:
        assert stream.get_final_response().output_text == whole.output_text


def test_function_calls_equal_chat_tool_calls(client):
    kwargs = dict(model="tiny-llama", input=ASK, tools=[WEATHER], tool_choice="required",
                  max_output_tokens=60, temperature=0)
    r = client.responses.create(**kwargs)
    c = chat(client, [{"role": "user", "content": ASK}], tools=[CHAT_WEATHER],
             tool_choice="required", max_tokens=60)
    (call,) = c.choices[0].message.tool_calls
    calls = [o for o in r.output if o.type == "function_call"]
    assert [(f.name, json.loads(f.arguments)) for f in calls] == [
        ("get_weather", json.loads(call.function.arguments))]
    events = list(client.responses.create(stream=True, **kwargs))
    args = "".join(e.delta for e in events
                   if e.type == "response.function_call_arguments.delta")
    assert json.loads(args) == json.loads(calls[0].arguments)
    named = client.responses.create(**kwargs | {"tool_choice": {"type": "function",
                                                                "name": "get_weather"}})
    assert [o.name for o in named.output if o.type == "function_call"] == ["get_weather"]


def test_function_call_outputs_continue_the_conversation(client):
    items = [{"role": "user", "content": ASK},
             {"type": "function_call", "call_id": "call_1", "name": "get_weather",
              "arguments": json.dumps({"city": "Paris"})},
             {"type": "function_call_output", "call_id": "call_1", "output": "18 C"}]
    r = client.responses.create(model="tiny-llama", input=items, tools=[WEATHER],
                                max_output_tokens=10, temperature=0)
    c = chat(client, [{"role": "user", "content": ASK},
                      {"role": "assistant", "content": None, "tool_calls": [
                          {"id": "call_1", "type": "function", "function": {
                              "name": "get_weather",
                              "arguments": json.dumps({"city": "Paris"})}}]},
                      {"role": "tool", "tool_call_id": "call_1", "content": "18 C"}],
             tools=[CHAT_WEATHER], max_tokens=10)
    assert r.usage.input_tokens == c.usage.prompt_tokens
    assert r.output_text == (c.choices[0].message.content or "")


def test_json_schema_format(client):
    r = client.responses.create(model="tiny-llama", input="Give a number.", temperature=0,
                                max_output_tokens=30, text={"format": {
                                    "type": "json_schema", "name": "n", "schema": SCHEMA}})
    jsonschema.validate(json.loads(r.output_text), SCHEMA)


@pytest.mark.parametrize("extra, words", [
    ({"store": True}, "store"),
    ({"previous_response_id": "resp_1"}, "previous_response_id"),
    ({"tools": [{"type": "web_search"}]}, "web_search"),
    ({"reasoning": {"summary": "auto"}}, "summary"),
    ({"input": [{"type": "reasoning", "summary": []}]}, "reasoning item"),
    ({"input": [{"type": "input_image", "image_url": "x"}]}, "input_image"),
])
def test_refused_by_name(server, extra, words):
    r = httpx.post(f"{server.base_url}/v1/responses",
                   json={"model": "tiny-llama", "input": "x"} | extra)
    assert r.status_code == 400 and words in r.json()["error"]["message"]
    server.wait_idle()
