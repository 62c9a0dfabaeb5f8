"""Tool-call parsers and tool plans: Hermes tags, Llama 3 JSON, pythonic call lists, Mistral's
[TOOL_CALLS] (both formats), Granite's and Phi-4-mini's marked arrays parse into calls with
JSON arguments, malformed calls stay content, `call_start` holds back what
may become a call, and tool_choice turns into the right constraint or a clear error."""

from __future__ import annotations

import json

import pytest

from tokenmill.server.protocol_chat import ChatTool, NamedToolChoice
from tokenmill.server.tool_parsers import (
    GraniteToolParser,
    HermesToolParser,
    Llama3JsonToolParser,
    MistralToolParser,
    Phi4MiniJsonToolParser,
    PythonicToolParser,
    Qwen3CoderToolParser,
    get_tool_parser,
)
from tokenmill.server.tools import ToolOptions, plan_tools

TOOL = {"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}}}


def test_hermes():
    p = HermesToolParser()
    text = ('Let me check.\n<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>'
            '<tool_call>{"name": "sub", "arguments": "{\\"b\\": 2}"}</tool_call>')
    content, calls = p.parse(text)
    assert content == "Let me check.\n"
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("add", {"a": 1}),
                                                                  ("sub", {"b": 2})]
    assert len({c.id for c in calls}) == 2
    assert p.parse('<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>')[0] is None
    broken = 'x <tool_call>{"name": "add", "arguments": {"a": </tool_call>'
    assert p.parse(broken) == (broken, [])
    assert p.parse("plain") == ("plain", [])
    assert p.call_start("abc <tool_") == 4
    assert p.call_start("abc <tool_call>{") == 4
    assert p.call_start("abc <b>") is None


def test_llama3_json():
    p = Llama3JsonToolParser()
    content, calls = p.parse('<|python_tag|>{"name": "add", "parameters": {"a": 1}}; '
                             '{"name": "add", "parameters": {"a": 2}}')
    assert content is None and [json.loads(c.arguments)["a"] for c in calls] == [1, 2]
    assert p.parse('{"answer": 3}') == ('{"answer": 3}', [])
    assert p.parse("The answer is 3.") == ("The answer is 3.", [])
    assert p.call_start("  {") == 0 and p.call_start("<|py") == 0
    assert p.call_start("Hello") is None
    with pytest.raises(ValueError, match="unknown tool call parser"):
        get_tool_parser("hermes2")


def named_args(calls) -> list[tuple[str, dict]]:
    return [(c.name, json.loads(c.arguments)) for c in calls]


def test_mistral_both_formats():
    p = MistralToolParser()
    old = 'Sure.[TOOL_CALLS] [{"name": "add", "arguments": {"a": 1}}, {"name": "sub", ' \
          '"arguments": {"b": 2}}]'
    content, calls = p.parse(old)
    assert content == "Sure." and named_args(calls) == [("add", {"a": 1}), ("sub", {"b": 2})]
    content, calls = p.parse('[TOOL_CALLS]add[ARGS]{"a": 1}[TOOL_CALLS]sub[CALL_ID]x1y2z3'
                             '[ARGS]{"b": 2}')
    assert content is None and named_args(calls) == [("add", {"a": 1}), ("sub", {"b": 2})]
    for broken in ('[TOOL_CALLS]add[ARGS]{"a": ', '[TOOL_CALLS]add{"a": 1}',
                   '[TOOL_CALLS] [{"a": 1}]', 'plain'):
        assert p.parse(broken) == (broken, [])
    assert p.call_start("ok [TOOL_") == 3 and p.call_start("ok") is None


@pytest.mark.parametrize("parser, marker", [
    (GraniteToolParser(), "<|tool_call|>"), (GraniteToolParser(), "<tool_call>"),
    (Phi4MiniJsonToolParser(), "functools")])
def test_marked_json_arrays(parser, marker):
    content, calls = parser.parse(f'Checking. {marker}[{{"name": "add", "arguments": '
                                  f'{{"a": 1}}}}] Done.')
    assert content == "Checking.  Done." and named_args(calls) == [("add", {"a": 1})]
    content, calls = parser.parse(f'{marker}[{{"name": "add", "arguments": {{"a": 2}}}}]')
    assert content is None and named_args(calls) == [("add", {"a": 2})]
    broken = f'{marker}[{{"name": "add", "arguments": '
    assert parser.parse(broken) == (broken, [])
    assert parser.call_start("x " + marker[:4]) == 2 and parser.call_start("x") is None


QWEN_TOOLS = [{"type": "function", "function": {"name": "book", "parameters": {
    "type": "object", "properties": {
        "city": {"type": "string"}, "nights": {"type": "integer"},
        "price": {"type": "number"}, "pets": {"type": "boolean"},
        "rooms": {"type": "array"}, "note": {"type": ["string", "null"]},
        "extra": {"type": "object"}}}}}]


def test_qwen3_coder_types_its_text_by_the_tools_schema():
    p = Qwen3CoderToolParser()
    text = ("Booking.\n<tool_call>\n<function=book>\n<parameter=city>\n007\n</parameter>\n"
            "<parameter=nights>\n3\n</parameter>\n<parameter=price>\n99.5\n</parameter>\n"
            "<parameter=pets>\nTrue\n</parameter>\n<parameter=rooms>\n[1, 2]\n</parameter>\n"
            "<parameter=note>\nnull\n</parameter>\n<parameter=extra>\n{\"a\": 1}\n"
            "</parameter>\n</function>\n</tool_call>")
    content, calls = p.parse(text, QWEN_TOOLS)
    assert content == "Booking.\n"
    assert named_args(calls) == [("book", {"city": "007", "nights": 3, "price": 99.5,
                                           "pets": True, "rooms": [1, 2], "note": "null",
                                           "extra": {"a": 1}})]
    # no schema (an unknown tool): JSON where it reads as JSON, else the text
    _, calls = p.parse("<tool_call>\n<function=f>\n<parameter=n>\n7\n</parameter>\n"
                       "<parameter=z>\n007\n</parameter>\n"
                       "<parameter=s>\nhi there\n</parameter>\n</function>\n</tool_call>")
    assert named_args(calls) == [("f", {"n": 7, "z": "007", "s": "hi there"})]
    _, calls = p.parse("<tool_call><function=book><parameter=nights>many</parameter>"
                       "</function></tool_call>", QWEN_TOOLS)
    assert named_args(calls) == [("book", {"nights": "many"})]  # not an integer: as written
    broken = "<tool_call>\n<function=book>\n<parameter=city>\nParis"
    assert p.parse(broken, QWEN_TOOLS) == (broken, [])
    assert p.call_start("ok <tool") == 3 and p.call_start("ok") is None


def test_pythonic():
    p = PythonicToolParser()
    content, calls = p.parse('[get_weather(city="San Francisco", days=3), '
                             'add(a=1, nums=[1, 2.5], opts={"x": None, "y": True})]')
    assert content is None
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "San Francisco", "days": 3}),
        ("add", {"a": 1, "nums": [1, 2.5], "opts": {"x": None, "y": True}})]
    wrapped = p.parse('<|python_start|>[noop()]<|python_end|>')
    assert wrapped[0] is None and [c.name for c in wrapped[1]] == ["noop"]
    # not calls: text as it came (nothing is ever evaluated)
    for text in ("The answer is [3].", "[1, 2]", "[f(1)]", "[f(x=y)]", "[f(**k)]",
                 "[os.system(cmd='ls')]", "[f(x={1, 2})]", "[f(x=1)", "[]"):
        assert p.parse(text) == (text, []), text
    assert p.call_start(" [") == 0 and p.call_start("<|python_") == 0
    assert p.call_start("Hello [") is None


def tools(*defs):
    return [ChatTool.model_validate(d) for d in defs]


def test_plans():
    compile_ok = lambda params: None  # noqa: E731
    auto = ToolOptions(True, "hermes")
    assert plan_tools(None, None, None, auto, compile_ok).mode == "none"
    assert plan_tools(tools(TOOL), "none", None, auto, compile_ok).tools == []
    plan = plan_tools(tools(TOOL), None, None, auto, compile_ok)
    assert plan.mode == "auto" and plan.tools[0]["function"]["name"] == "add"
    plan = plan_tools(tools(TOOL), "required", False, auto, compile_ok)
    assert plan.constraint.json["maxItems"] == 1
    assert plan.calls('[{"name": "add", "arguments": {"a": 5}}]')[1][0].name == "add"
    # an array cut by max_tokens: its complete calls, never the JSON as content
    content, calls = plan.calls('[{"name": "add", "arguments": {"a": 5}}, {"name": "add", '
                                '"arguments": {"a"')
    assert content is None and [json.loads(c.arguments) for c in calls] == [{"a": 5}]
    assert plan.calls('[{"name": "ad') == (None, [])
    # parallel_tool_calls false, "auto": the first call only
    two = ('<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>'
           '<tool_call>{"name": "add", "arguments": {"a": 2}}</tool_call>')
    assert len(plan_tools(tools(TOOL), "auto", None, auto, compile_ok).calls(two)[1]) == 2
    assert len(plan_tools(tools(TOOL), "auto", False, auto, compile_ok).calls(two)[1]) == 1
    named = NamedToolChoice.model_validate({"type": "function", "function": {"name": "add"}})
    plan = plan_tools(tools(TOOL), named, None, auto, compile_ok)
    assert plan.constraint.json == TOOL["function"]["parameters"]
    content, calls = plan.calls('{"a": 7}')
    assert content is None and json.loads(calls[0].arguments) == {"a": 7}
    assert plan.calls('{"a": ') == (None, [])  # cut off: no call, and no JSON as text
    with pytest.raises(ValueError, match="enable-auto-tool-choice"):
        plan_tools(tools(TOOL), "auto", None, ToolOptions(), compile_ok)
    with pytest.raises(ValueError, match="needs --tool-call-parser"):
        ToolOptions(True, None)


QWEN_LIKE = (
    "{%- if tools %}<|im_start|>system\n{%- for t in tools %}{{ t | tojson }}\n{%- endfor %}"
    "<|im_end|>\n{%- endif %}{%- for m in messages %}<|im_start|>{{ m.role }}\n"
    "{%- if m.tool_calls %}{%- for c in m.tool_calls %}<tool_call>{{ c.function | tojson }}"
    "</tool_call>{%- endfor %}{%- else %}{{ m.content }}{%- endif %}<|im_end|>\n"
    "{%- endfor %}<|im_start|>assistant\n")


def test_tools_reach_the_prompt_with_either_kind_of_template(tiny_model):
    from tokenmill.engine.llm_engine import LLMEngine
    from tokenmill.server.chat_rendering import render_chat
    from tokenmill.server.protocol_chat import ChatMessage

    engine = LLMEngine.from_options(tiny_model("llama")[0], max_model_len=512,
                                    num_kv_blocks=64)
    messages = [ChatMessage.model_validate(m) for m in [
        {"role": "user", "content": "Add 1."},
        {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function", "function": {
            "name": "add", "arguments": '{"a": 1}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "2"}]]
    plan = plan_tools(tools(TOOL), "required", None, ToolOptions(), lambda p: None)
    fallback = render_chat(engine, messages, tools=plan.tools)["prompt"]  # SmolLM2's ChatML
    assert "<tools>" in fallback and '"name": "add"' in fallback
    assert '<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>' in fallback
    assert "<tool_response>\n2\n</tool_response>" in fallback
    engine.tokenizer.chat_template = QWEN_LIKE
    native = render_chat(engine, messages, tools=plan.tools)["prompt"]
    assert "<tools>" not in native  # the template renders them itself
    assert '"name": "add"' in native.split("<|im_end|>")[0]
    assert '<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>' in native  # an object


def test_special_markers_keep_the_special_tokens(tiny_model):
    """A parser whose marker is a special token of the tokenizer (Mistral's [TOOL_CALLS],
    Granite 3.0's <|tool_call|>) gets the answer detokenized with its special tokens."""
    from tokenmill.config_model import model_config
    from tokenmill.engine.tokenizer import load_tokenizer
    from tokenmill.server.chat_rendering import skipped_on_decode

    tok = load_tokenizer(model_config(tiny_model("llama")[0]))
    assert skipped_on_decode(tok, "<|im_start|>") and skipped_on_decode(tok, "<empty_output>")
    assert not skipped_on_decode(tok, "<tool_call>") and not skipped_on_decode(tok, "[TOOL_CALLS]")
    assert not skipped_on_decode(tok, "functools")
