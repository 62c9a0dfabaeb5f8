"""Anthropic's Messages API with the official `anthropic` client: answers (text, streamed or
not, tool uses, a conversation with tool results) equal the same conversation through chat
completions at temperature 0; count_tokens equals the chat prompt's length; bad fields,
unsupported blocks, unknown models and bad keys are refused in Anthropic's error shape."""

from __future__ import annotations

import json

import anthropic
import httpx
import openai
import pytest

from tests.server.conftest import start_server
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.server.tools import ToolOptions

WEATHER = {"name": "get_weather", "description": "Current weather in a city.",
           "input_schema": {"type": "object",
                            "properties": {"city": {"type": "string", "maxLength": 12}},
                            "required": ["city"]}}
OPENAI_WEATHER = {"type": "function", "function": {
    "name": WEATHER["name"], "description": WEATHER["description"],
    "parameters": WEATHER["input_schema"]}}
SYSTEM = "You answer briefly."
ASK = "What is the weather in Paris?"
# the client (anthropic 2.x) no longer has sampling keywords; older ones send them as fields
GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def server(tiny_model):
    path, _ = tiny_model("llama")
    engine = LLMEngine.from_options(path, max_model_len=512, num_kv_blocks=300)
    yield from start_server(engine, "tiny-llama", api_key="secret",
                            tool_options=ToolOptions(True, "hermes"))


@pytest.fixture(scope="module")
def claude(server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.base_url, api_key="secret", max_retries=0)


@pytest.fixture(scope="module")
def gpt(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="secret", max_retries=0)


def chat(gpt: openai.OpenAI, messages: list[dict], **kwargs):
    return gpt.chat.completions.create(model="tiny-llama", temperature=0, messages=messages,
                                       **kwargs)


def test_text_equals_chat_completions(claude, gpt):
    m = claude.messages.create(model="tiny-llama", max_tokens=12, extra_body=GREEDY,
                               system=SYSTEM, messages=[{"role": "user", "content": ASK}])
    c = chat(gpt, [{"role": "system", "content": SYSTEM}, {"role": "user", "content": ASK}],
             max_tokens=12)
    assert m.type == "message" and m.role == "assistant" and m.model == "tiny-llama"
    assert [b.type for b in m.content] == ["text"]
    assert m.content[0].text == c.choices[0].message.content
    assert m.usage.input_tokens == c.usage.prompt_tokens
    assert m.usage.output_tokens == c.usage.completion_tokens
    assert m.stop_reason == {"length": "max_tokens", "stop": "end_turn"}[
        c.choices[0].finish_reason]


def test_streamed_text_equals_the_whole_message(claude):
    kwargs = dict(model="tiny-llama", max_tokens=12, extra_body=GREEDY,
                  system=[{"type": "text", "text": SYSTEM}],
                  messages=[{"role": "user", "content": [{"type": "text", "text": ASK}]}])
    whole = claude.messages.create(**kwargs)
    with claude.messages.stream(**kwargs) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == whole.content[0].text == final.content[0].text
    assert final.stop_reason == whole.stop_reason
    assert final.usage.output_tokens == whole.usage.output_tokens


def test_tool_use_equals_chat_tool_calls(claude, gpt):
    kwargs = dict(model="tiny-llama", max_tokens=60, extra_body=GREEDY, tools=[WEATHER],
                  tool_choice={"type": "any"}, messages=[{"role": "user", "content": ASK}])
    m = claude.messages.create(**kwargs)
    c = chat(gpt, [{"role": "user", "content": ASK}], max_tokens=60, tools=[OPENAI_WEATHER],
             tool_choice="required")
    (call,) = c.choices[0].message.tool_calls
    uses = [b for b in m.content if b.type == "tool_use"]
    assert m.stop_reason == "tool_use" and len(uses) == 1
    assert uses[0].name == "get_weather" and uses[0].input == json.loads(call.function.arguments)
    with claude.messages.stream(**kwargs) as stream:
        final = stream.get_final_message()
    streamed = [b for b in final.content if b.type == "tool_use"]
    assert [(b.name, b.input) for b in streamed] == [(b.name, b.input) for b in uses]
    assert final.stop_reason == "tool_use"


def test_a_conversation_with_tool_results(claude, gpt):
    history = [{"role": "user", "content": ASK},
               {"role": "assistant", "content": [
                   {"type": "text", "text": "Let me check."},
                   {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                    "input": {"city": "Paris"}}]},
               {"role": "user", "content": [
                   {"type": "tool_result", "tool_use_id": "toolu_1", "content": "18 C, sunny"},
                   {"type": "text", "text": "Summarise."}]}]
    m = claude.messages.create(model="tiny-llama", max_tokens=10, extra_body=GREEDY,
                               tools=[WEATHER], messages=history)
    c = chat(gpt, [{"role": "user", "content": ASK},
                   {"role": "assistant", "content": "Let me check.", "tool_calls": [
                       {"id": "toolu_1", "type": "function", "function": {
                           "name": "get_weather", "arguments": json.dumps({"city": "Paris"})}}]},
                   {"role": "tool", "tool_call_id": "toolu_1", "content": "18 C, sunny"},
                   {"role": "user", "content": "Summarise."}],
             max_tokens=10, tools=[OPENAI_WEATHER])
    assert m.usage.input_tokens == c.usage.prompt_tokens
    text = "".join(b.text for b in m.content if b.type == "text")
    assert text == (c.choices[0].message.content or "")
    counted = claude.messages.count_tokens(model="tiny-llama", tools=[WEATHER],
                                           messages=history)
    assert counted.input_tokens == c.usage.prompt_tokens


@pytest.mark.parametrize("body, status, kind, words", [
    ({"max_tokens": 5, "messages": [{"role": "user", "content": "x"}], "thinking": {}},
     400, "invalid_request_error", "thinking"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {}}]}]}, 400, "invalid_request_error", "'image'"),
    ({"messages": [{"role": "user", "content": "x"}]}, 400, "invalid_request_error",
     "max_tokens"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": "x"}],
      "tool_choice": {"type": "sometimes"}}, 400, "invalid_request_error", "tool_choice"),
    ({"model": "no-such-model", "max_tokens": 5,
      "messages": [{"role": "user", "content": "x"}]}, 404, "not_found_error", "no-such-model"),
])
def test_errors_in_anthropics_shape(server, body, status, kind, words):
    r = httpx.post(f"{server.base_url}/v1/messages", headers={"x-api-key": "secret"},
                   json={"model": "tiny-llama"} | body)
    assert r.status_code == status
    assert r.json()["type"] == "error" and r.json()["error"]["type"] == kind
    assert words in r.json()["error"]["message"]


def test_the_key_is_x_api_key(server):
    bad = anthropic.Anthropic(base_url=server.base_url, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError):
        bad.messages.create(model="tiny-llama", max_tokens=5,
                            messages=[{"role": "user", "content": "x"}])
    r = httpx.post(f"{server.base_url}/v1/messages", content=b"{",
                   headers={"x-api-key": "secret"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    server.wait_idle()


def test_stop_sequences_end_the_message(claude):
    kwargs = dict(model="tiny-llama", max_tokens=16, extra_body=GREEDY,
                  messages=[{"role": "user", "content": ASK}])
    text = claude.messages.create(**kwargs).content[0].text
    stop = text[len(text) // 2:len(text) // 2 + 3]
    assert stop.strip(), text
    m = claude.messages.create(**kwargs, stop_sequences=[stop])
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == stop
    assert m.content[0].text == text[:text.index(stop)]


def test_output_config_format_constrains_the_answer_to_the_schema(claude):
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
              "additionalProperties": False}
    msg = claude.messages.create(model="tiny-llama", max_tokens=40, messages=[
        {"role": "user", "content": "A number?"}], extra_body={
        "output_config": {"format": {"type": "json_schema", "schema": schema}}})
    assert msg.stop_reason == "end_turn"
    assert isinstance(json.loads(msg.content[0].text)["n"], int)
