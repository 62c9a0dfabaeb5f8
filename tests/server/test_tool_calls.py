"""Tool calling behind the OpenAI server, with the official client, on SmolLM2: "required" and
named functions give calls whose arguments validate against the tools' schemas; "auto" parses
Hermes-format calls out of the text into message.tool_calls; finish_reason is "tool_calls";
streamed tool-call deltas assemble to the same calls as the whole answer at temperature 0;
"none" answers in text; bad tools and tool choices are 400s."""

from __future__ import annotations

import json
from collections.abc import Iterator

import jsonschema
import openai
import pytest

from tests.server.conftest import RunningServer, start_server
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.server.tools import ToolOptions

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city.",
    "parameters": {"type": "object",
                   "properties": {"city": {"type": "string", "maxLength": 40},
                                  "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "Current local time in a time zone.",
    "parameters": {"type": "object",
                   "properties": {"timezone": {"type": "string", "maxLength": 40}},
                   "required": ["timezone"]}}}
TOOLS = [WEATHER, TIME]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather like in Paris right now?"}]


@pytest.fixture(scope="module")
def server(smollm2_path) -> Iterator[RunningServer]:
    engine = LLMEngine.from_options(smollm2_path, kv_cache_memory="256MiB")
    yield from start_server(engine, "smollm2",
                            tool_options=ToolOptions(True, "hermes"))


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0)


def create(client: openai.OpenAI, **kwargs):
    return client.chat.completions.create(
        model="smollm2", temperature=0,
        **({"messages": ASK, "tools": TOOLS, "max_tokens": 120} | kwargs))


def streamed_calls(client: openai.OpenAI, **kwargs) -> tuple[str, list[dict], str]:
    """(content, calls, finish_reason) assembled from a stream's deltas."""
    content, calls, finish = "", {}, None
    for chunk in create(client, stream=True, **kwargs):
        for ch in chunk.choices:
            content += ch.delta.content or ""
            for d in ch.delta.tool_calls or []:
                call = calls.setdefault(d.index, {"id": "", "name": "", "arguments": ""})
                call["id"] += d.id or ""
                call["name"] += d.function.name or ""
                call["arguments"] += d.function.arguments or ""
            finish = ch.finish_reason or finish
    return content, [calls[i] for i in sorted(calls)], finish


def check_calls(message) -> list[tuple[str, dict]]:
    out = []
    for call in message.tool_calls:
        assert call.type == "function" and call.id.startswith("call_")
        args = json.loads(call.function.arguments)
        jsonschema.validate(args, SCHEMAS[call.function.name])
        out.append((call.function.name, args))
    return out


def test_named_function_call_validates_and_streams_the_same(client, server):
    choice = {"type": "function", "function": {"name": "get_weather"}}
    r = create(client, tool_choice=choice)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content is None
    ((name, args),) = check_calls(c.message)
    assert name == "get_weather"
    content, calls, finish = streamed_calls(client, tool_choice=choice)
    assert content == "" and finish == "tool_calls"
    assert [(x["name"], json.loads(x["arguments"])) for x in calls] == [(name, args)]
    server.wait_idle()


def test_required_gives_calls_of_the_given_tools(client):
    r = create(client, tool_choice="required")
    c = r.choices[0]
    assert c.finish_reason == "tool_calls"
    calls = check_calls(c.message)
    assert calls and all(name in SCHEMAS for name, _ in calls)
    r = create(client, tool_choice="required", parallel_tool_calls=False)
    assert len(r.choices[0].message.tool_calls) == 1


MANY = [{"role": "user",
         "content": "What is the weather in Paris and in Rome, and the time in Tokyo?"}]


def test_a_cut_answer_returns_its_complete_calls(client):
    """SmolLM2 repeats calls until max_tokens here: the answer is the complete calls (a
    prefix of a longer answer's), finish_reason "length", no JSON as content; streamed alike."""
    longer = check_calls(create(client, messages=MANY, tool_choice="required",
                                max_tokens=120).choices[0].message)
    r = create(client, messages=MANY, tool_choice="required", max_tokens=60)
    c = r.choices[0]
    assert c.finish_reason == "length" and c.message.content is None
    calls = check_calls(c.message)
    assert len(calls) >= 2 and calls == longer[:len(calls)]
    content, streamed, finish = streamed_calls(client, messages=MANY, tool_choice="required",
                                               max_tokens=60)
    assert content == "" and finish == "length"
    assert [(x["name"], json.loads(x["arguments"])) for x in streamed] == calls


def test_parallel_tool_calls_false_ends_the_answer_after_one_call(client):
    r = create(client, messages=MANY, tool_choice="required", parallel_tool_calls=False,
               max_tokens=300)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and len(check_calls(c.message)) == 1
    assert r.usage.completion_tokens < 60  # the grammar ended the array after one call


def test_auto_parses_hermes_calls_out_of_the_text(client):
    """The model's text is forced (a regex) into a Hermes tool call, so that parsing is
    checked whatever SmolLM2 would choose."""
    forced = (r'<tool_call>\n\{"name": "get_time", "arguments": '
              r'\{"timezone": "[A-Z][a-z]{2,8}"\}\}\n</tool_call>')
    r = create(client, tool_choice="auto", extra_body={"guided_regex": forced})
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content is None
    ((name, _),) = check_calls(c.message)
    assert name == "get_time"
    content, calls, finish = streamed_calls(client, tool_choice="auto",
                                            extra_body={"guided_regex": forced})
    assert content == "" and finish == "tool_calls"
    assert [(x["name"], x["arguments"]) for x in calls] == [
        (t.function.name, t.function.arguments) for t in c.message.tool_calls]


def test_auto_text_answer_streams_as_content(client):
    kwargs = {"tool_choice": "auto", "messages": [{"role": "user", "content": "Say hello."}],
              "max_tokens": 20}
    r = create(client, **kwargs)
    c = r.choices[0]
    assert c.message.tool_calls is None and c.message.content
    content, calls, finish = streamed_calls(client, **kwargs)
    assert (content, calls, finish) == (c.message.content, [], c.finish_reason)


def test_none_and_a_conversation_with_earlier_calls(client):
    r = create(client, tool_choice="none", max_tokens=20)
    assert r.choices[0].message.tool_calls is None and r.choices[0].message.content
    history = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather",
                          "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21}'}]
    r = create(client, messages=history, tool_choice="none", max_tokens=30)
    assert r.choices[0].finish_reason in ("stop", "length") and r.choices[0].message.content


@pytest.mark.parametrize("kwargs, message", [
    ({"tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object",
                                    "properties": {"a": {"type": "strin"}}}}}]}, "strin"),
    ({"tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "string"}}}]}, "object"),
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "nope"),
    ({"tools": None, "tool_choice": "required"}, "only allowed with tools"),
    ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "combined"),
    ({"tools": [WEATHER, WEATHER]}, "distinct"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "name"),
])
def test_bad_tools_are_400(client, server, kwargs, message):
    with pytest.raises(openai.BadRequestError, match=message):
        create(client, **kwargs)
    server.wait_idle()


def test_auto_needs_the_server_flags(smollm2_path):
    engine = LLMEngine.from_options(smollm2_path, kv_cache_memory="64MiB")
    for srv in start_server(engine, "smollm2"):
        c = openai.OpenAI(base_url=f"{srv.base_url}/v1", api_key="x", max_retries=0)
        with pytest.raises(openai.BadRequestError, match="enable-auto-tool-choice"):
            create(c)  # tools without tool_choice mean "auto"
        r = create(c, tool_choice="required")
        assert r.choices[0].finish_reason == "tool_calls"


def test_auto_parses_pythonic_calls(tiny_model):
    """--tool-call-parser pythonic: a forced `[name(key=value)]` answer comes back as calls,
    whole and streamed alike."""
    engine = LLMEngine.from_options(tiny_model("llama")[0], max_model_len=512,
                                    num_kv_blocks=96)
    forced = ['[get_time(timezone="Europe/Paris"), get_weather(city="Paris", unit="celsius")]']
    for srv in start_server(engine, "smollm2", tool_options=ToolOptions(True, "pythonic")):
        c = openai.OpenAI(base_url=f"{srv.base_url}/v1", api_key="x", max_retries=0)
        r = create(c, tool_choice="auto", extra_body={"guided_choice": forced})
        content, calls, finish = streamed_calls(c, tool_choice="auto",
                                                extra_body={"guided_choice": forced})
        srv.wait_idle()
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    want = [("get_time", {"timezone": "Europe/Paris"}),
            ("get_weather", {"city": "Paris", "unit": "celsius"})]
    assert check_calls(choice.message) == want
    assert content == "" and finish == "tool_calls"
    assert [(x["name"], json.loads(x["arguments"])) for x in calls] == want


def test_a_special_token_marker_survives_detokenization(tiny_model, monkeypatch):
    """A parser whose marker is a special token (Mistral's [TOOL_CALLS]; here SmolLM2's
    <empty_output>, id 16) sees it in the text: the answer keeps its special tokens. The
    model is made to write it (logit_bias) and then a call."""
    from tokenmill.server import tool_parsers

    class SpecialMarked(tool_parsers.MarkedJsonToolParser):
        name, markers = "special_marked", ("<empty_output>",)

    monkeypatch.setitem(tool_parsers.TOOL_PARSERS, SpecialMarked.name, SpecialMarked)
    engine = LLMEngine.from_options(tiny_model("llama")[0], max_model_len=512,
                                    num_kv_blocks=32)
    for srv in start_server(engine, "m", tool_options=ToolOptions(True, SpecialMarked.name)):
        client = openai.OpenAI(base_url=f"{srv.base_url}/v1", api_key="x", max_retries=0)
        r = client.chat.completions.create(
            model="m", messages=ASK, tools=TOOLS, max_tokens=1, logit_bias={"16": 100})
        assert r.choices[0].message.content == "<empty_output>"  # held, then not a call
        plain = client.chat.completions.create(model="m", messages=ASK, max_tokens=1,
                                               logit_bias={"16": 100})
        assert plain.choices[0].message.content == ""  # no tools: skipped as asked


def test_qwen3_coder_calls_come_back_typed_by_the_schema(tiny_model):
    """--tool-call-parser qwen3_coder: the XML call (made certain by a choice constraint)
    comes back as tool_calls whose arguments the tool's schema typed."""
    call = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
            "<parameter=unit>\ncelsius\n</parameter>\n</function>\n</tool_call>")
    engine = LLMEngine.from_options(tiny_model("llama")[0], max_model_len=512,
                                    num_kv_blocks=64)
    for srv in start_server(engine, "m", tool_options=ToolOptions(True, "qwen3_coder")):
        client = openai.OpenAI(base_url=f"{srv.base_url}/v1", api_key="x", max_retries=0)
        r = client.chat.completions.create(model="m", messages=ASK, tools=TOOLS,
                                           max_tokens=80, temperature=0,
                                           extra_body={"guided_choice": [call]})
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        (got,) = choice.message.tool_calls
        assert got.function.name == "get_weather"
        assert json.loads(got.function.arguments) == {"city": "Paris", "unit": "celsius"}
        srv.wait_idle()
