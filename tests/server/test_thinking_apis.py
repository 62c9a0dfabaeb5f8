"""Thinking budgets and reasoning across the APIs, on a server whose engine gates grammars
behind the reasoning (deepseek_r1: the tiny model reasons from its first token) and whose
chat template shows what reaches it (an assistant turn's reasoning, reasoning_effort,
enable_thinking):

- chat: thinking_token_budget ends the reasoning after so many tokens, and a guided choice
  then constrains the content only (whole and streamed alike);
- reasoning_effort reaches the template as vLLM passes it (enable_thinking false for
  "none"; the request's own chat_template_kwargs win); an earlier turn's reasoning (chat's
  reasoning / reasoning_content, Messages' thinking blocks) reaches it as reasoning_content;
- Messages: thinking {"type": "enabled", "budget_tokens": 1024} answers as chat with
  thinking_token_budget 1024 does: a thinking block of its reasoning, then the text block
  (the anthropic client's stream assembles the same); disabled maps to effort "none"; a
  budget not under max_tokens is a 400."""

from __future__ import annotations

import json

import anthropic
import httpx
import pytest

from tests.server.conftest import start_server
from tokenmill.engine.llm_engine import LLMEngine

TEMPLATE = (
    "{% for m in messages %}{{ m.role }}:{% if m.reasoning_content %}[r:{{ m.reasoning_content }}]"
    "{% endif %}{{ m.content }}\n{% endfor %}"
    "{% if reasoning_effort is defined %}effort={{ reasoning_effort }}\n{% endif %}"
    "{% if enable_thinking is defined and not enable_thinking %}no-think\n{% endif %}"
    "{% if add_generation_prompt %}assistant:{% endif %}")
CHOICES = ["alpha", "beta gamma", "delta"]
HI = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def server(tiny_model):
    engine = LLMEngine.from_options(
        tiny_model("llama")[0], max_model_len=2048, num_kv_blocks=300,
        hf_overrides={"max_position_embeddings": 2048}, reasoning_parser="deepseek_r1",
        chat_template=TEMPLATE)
    yield from start_server(engine, "m")


def chat(srv, **fields) -> dict:
    r = httpx.post(f"{srv.base_url}/v1/chat/completions", timeout=120,
                   json={"model": "m", "temperature": 0, "messages": HI} | fields)
    assert r.status_code == 200, r.text
    return r.json()


def rendered_tokens(srv, text: str) -> int:
    r = httpx.post(f"{srv.base_url}/tokenize", json={"model": "m", "prompt": text,
                                                      "add_special_tokens": False})
    return r.json()["count"]


def test_a_budget_ends_the_reasoning_and_the_grammar_takes_the_answer(server):
    body = chat(server, max_tokens=40, thinking_token_budget=4, guided_choice=CHOICES)
    message, usage = body["choices"][0]["message"], body["usage"]
    assert message["content"] in CHOICES and message["reasoning"]
    assert "</think>" not in message["reasoning"]
    tok = server.engine.tokenizer
    answer = len(tok.encode(message["content"], add_special_tokens=False))
    # the budget, "</think>"'s 3 tokens, the choice and the EOS that ends it
    assert usage["completion_tokens"] == 4 + 3 + answer + 1
    reasoning, content = "", ""
    with httpx.stream("POST", f"{server.base_url}/v1/chat/completions", timeout=120, json={
            "model": "m", "temperature": 0, "messages": HI, "max_tokens": 40, "stream": True,
            "thinking_token_budget": 4, "guided_choice": CHOICES}) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                delta = json.loads(line[6:])["choices"][0]["delta"]
                reasoning += delta.get("reasoning") or ""
                content += delta.get("content") or ""
    assert (reasoning, content) == (message["reasoning"], message["content"])
    server.wait_idle()


@pytest.mark.parametrize("fields, rendered", [
    ({}, "user:hi\nassistant:"),
    ({"reasoning_effort": "none"}, "user:hi\neffort=none\nno-think\nassistant:"),
    ({"reasoning_effort": "high"}, "user:hi\neffort=high\nassistant:"),
    ({"reasoning_effort": "high", "chat_template_kwargs": {"enable_thinking": False}},
     "user:hi\neffort=high\nno-think\nassistant:"),
    ({"messages": [*HI, {"role": "assistant", "content": "yo", "reasoning": "greet"},
                   {"role": "user", "content": "bye"}]},
     "user:hi\nassistant:[r:greet]yo\nuser:bye\nassistant:"),
    ({"messages": [*HI, {"role": "assistant", "content": "yo", "reasoning_content": "greet"},
                   {"role": "user", "content": "bye"}]},
     "user:hi\nassistant:[r:greet]yo\nuser:bye\nassistant:"),
])
def test_what_reaches_the_template(server, fields, rendered):
    usage = chat(server, max_tokens=1, **fields)["usage"]
    assert usage["prompt_tokens"] == rendered_tokens(server, rendered)


def test_reasoning_belongs_to_assistant_turns(server):
    r = httpx.post(f"{server.base_url}/v1/chat/completions", json={
        "model": "m", "messages": [{"role": "user", "content": "hi", "reasoning": "x"}]})
    assert r.status_code == 400 and "assistant" in r.json()["error"]["message"]


@pytest.fixture(scope="module")
def claude(server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.base_url, api_key="x", max_retries=0)


def test_messages_thinking_enabled_thinks_its_budget_then_answers(server, claude):
    kwargs = dict(model="m", max_tokens=1040, messages=HI, extra_body={"temperature": 0},
                  thinking={"type": "enabled", "budget_tokens": 1024})
    msg = claude.messages.create(**kwargs)
    assert [b.type for b in msg.content] == ["thinking", "text"]
    thinking, text = msg.content
    assert thinking.signature and "</think>" not in thinking.thinking
    assert msg.usage.output_tokens == 1040 and msg.stop_reason == "max_tokens"
    same = chat(server, max_tokens=1040, thinking_token_budget=1024,
                chat_template_kwargs={"enable_thinking": True})["choices"][0]["message"]
    assert (thinking.thinking, text.text) == (same["reasoning"], same["content"])
    with claude.messages.stream(**kwargs) as stream:
        streamed = stream.get_final_message()
    assert [b.type for b in streamed.content] == ["thinking", "text"]
    assert streamed.content[0].thinking == thinking.thinking
    assert streamed.content[1].text == text.text and streamed.content[0].signature
    server.wait_idle()


def test_messages_thinking_in_and_out_of_the_template(server, claude):
    history = [*HI, {"role": "assistant", "content": [
        {"type": "thinking", "thinking": "greet", "signature": "s"},
        {"type": "redacted_thinking", "data": "opaque"},
        {"type": "text", "text": "yo"}]}, {"role": "user", "content": "bye"}]
    counted = claude.messages.count_tokens(model="m", messages=history)
    assert counted.input_tokens == rendered_tokens(
        server, "user:hi\nassistant:[r:greet]yo\nuser:bye\nassistant:")
    off = claude.messages.count_tokens(model="m", messages=HI, thinking={"type": "disabled"})
    assert off.input_tokens == rendered_tokens(server,
                                               "user:hi\neffort=none\nno-think\nassistant:")


def test_messages_budget_must_be_under_max_tokens(server, claude):
    with pytest.raises(anthropic.BadRequestError, match="budget_tokens"):
        claude.messages.create(model="m", max_tokens=1024, messages=HI,
                               thinking={"type": "enabled", "budget_tokens": 1024})
    with pytest.raises(anthropic.BadRequestError):
        claude.messages.create(model="m", max_tokens=2000, messages=HI,
                               thinking={"type": "enabled", "budget_tokens": 10})


def test_completions_take_a_budget_too(server):
    r = httpx.post(f"{server.base_url}/v1/completions", timeout=60, json={
        "model": "m", "prompt": "hi", "max_tokens": 6, "temperature": 0,
        "thinking_token_budget": 2, "logprobs": 0, "return_tokens_as_token_ids": True})
    assert r.status_code == 200, r.text
    tokens = r.json()["choices"][0]["logprobs"]["tokens"]
    assert tokens[2:5] == ["token_id:9617", "token_id:17400", "token_id:46"]  # "</think>"


def test_messages_output_config_effort_reaches_the_template(server, claude):
    high = claude.messages.count_tokens(model="m", messages=HI,
                                        extra_body={"output_config": {"effort": "high"}})
    assert high.input_tokens == rendered_tokens(server, "user:hi\neffort=high\nassistant:")
    off = claude.messages.count_tokens(model="m", messages=HI, thinking={"type": "disabled"},
                                       extra_body={"output_config": {"effort": "high"}})
    assert off.input_tokens == rendered_tokens(server,
                                               "user:hi\neffort=none\nno-think\nassistant:")
