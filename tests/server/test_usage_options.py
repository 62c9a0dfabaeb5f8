"""What answers carry by vLLM's flags: usage's prompt_tokens_details.cached_tokens (the
prompt tokens served from the prefix cache; --enable-prompt-tokens-details), a usage chunk
ending every stream (--enable-force-include-usage), the chat answer's role (--response-role)
and logprobs' tokens as "token_id:N" (--return-tokens-as-token-ids, or a request's field);
without them, vLLM's defaults."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.server.conftest import start_server
from tokenmill.cli import build_parser, serving_options
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.server.serving_common import ServingOptions

PROMPT = [2000 + 13 * i for i in range(40)]  # two full blocks of 16, then 8 tokens


@pytest.fixture(scope="module")
def server(tiny_model):
    engine = LLMEngine.from_options(tiny_model("llama")[0], max_model_len=256, num_kv_blocks=64)
    options = ServingOptions(prompt_tokens_details=True, force_include_usage=True,
                             response_role="bot", tokens_as_ids=True)
    yield from start_server(engine, "m", answers=options)


def _events(srv, path: str, body: dict) -> list[dict]:
    with httpx.stream("POST", f"{srv.base_url}{path}", timeout=60,
                      json={"model": "m", "stream": True, **body}) as r:
        return [json.loads(line[6:]) for line in r.iter_lines()
                if line.startswith("data: {")]


def test_cached_tokens_count_the_prefix_cache_hit(server):
    body = {"model": "m", "prompt": PROMPT, "max_tokens": 2, "temperature": 0}
    first = httpx.post(f"{server.base_url}/v1/completions", json=body).json()["usage"]
    again = httpx.post(f"{server.base_url}/v1/completions", json=body).json()["usage"]
    assert first["prompt_tokens_details"] == {"cached_tokens": 0}
    assert again["prompt_tokens_details"] == {"cached_tokens": 32}  # its two full blocks
    # streamed (usage forced: no stream_options asked), the same count
    streamed = _events(server, "/v1/completions", {k: v for k, v in body.items()
                                                   if k != "model"})
    assert streamed[-1]["choices"] == []
    assert streamed[-1]["usage"]["prompt_tokens_details"] == {"cached_tokens": 32}
    assert streamed[-1]["usage"]["completion_tokens"] == 2
    server.wait_idle()


def test_the_chat_answer_s_role(server):
    messages = [{"role": "user", "content": "Hello"}]
    whole = httpx.post(f"{server.base_url}/v1/chat/completions", json={
        "model": "m", "messages": messages, "max_tokens": 2}).json()
    assert whole["choices"][0]["message"]["role"] == "bot"
    assert "prompt_tokens_details" in whole["usage"]
    events = _events(server, "/v1/chat/completions", {"messages": messages, "max_tokens": 2})
    assert events[0]["choices"][0]["delta"]["role"] == "bot"
    assert events[-1]["usage"]["completion_tokens"] == 2  # forced
    # continuing the last message instead of answering it: that message's role
    cont = httpx.post(f"{server.base_url}/v1/chat/completions", json={
        "model": "m", "messages": [*messages, {"role": "assistant", "content": "Hi"}],
        "add_generation_prompt": False, "max_tokens": 2}).json()
    assert cont["choices"][0]["message"]["role"] == "assistant"
    server.wait_idle()


def test_tokens_as_token_ids(server, tiny_server):
    body = {"prompt": PROMPT[:5], "max_tokens": 2, "logprobs": 2, "echo": True,
            "temperature": 0}
    named = httpx.post(f"{server.base_url}/v1/completions", json={"model": "m", **body}).json()
    lps = named["choices"][0]["logprobs"]
    assert lps["tokens"][:5] == [f"token_id:{t}" for t in PROMPT[:5]]
    assert all(k.startswith("token_id:") for top in lps["top_logprobs"][1:] for k in top)
    as_text = httpx.post(f"{server.base_url}/v1/completions", json={
        "model": "m", "return_tokens_as_token_ids": False, **body}).json()
    assert as_text["choices"][0]["logprobs"]["tokens"][1] == \
        server.engine.tokenizer.decode([PROMPT[1]])
    chat = httpx.post(f"{tiny_server.base_url}/v1/chat/completions", json={
        "model": tiny_server.model, "messages": [{"role": "user", "content": "Hi"}],
        "max_tokens": 2, "logprobs": True, "top_logprobs": 1, "temperature": 0,
        "return_tokens_as_token_ids": True}).json()
    (first, second) = chat["choices"][0]["logprobs"]["content"]
    assert first["token"].startswith("token_id:")
    assert first["bytes"] == list(first["token"].encode())
    assert first["top_logprobs"][0]["token"] == first["token"]  # greedy: the top 1
    server.wait_idle()
    tiny_server.wait_idle()


def test_without_the_flags_vllm_s_defaults(tiny_server):
    body = {"model": tiny_server.model, "prompt": PROMPT, "max_tokens": 2}
    r = httpx.post(f"{tiny_server.base_url}/v1/completions", json=body).json()
    assert r["usage"]["prompt_tokens_details"] is None
    events = _events(tiny_server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 2,
                                                      "model": tiny_server.model})
    assert all("usage" not in e for e in events)
    tiny_server.wait_idle()


def test_serve_parses_the_answer_flags():
    parser = build_parser()
    args = parser.parse_args(["serve", "m", "--enable-prompt-tokens-details",
                              "--enable-force-include-usage", "--response-role", "bot",
                              "--return-tokens-as-token-ids"])
    assert serving_options(args) == ServingOptions(
        prompt_tokens_details=True, force_include_usage=True, response_role="bot",
        tokens_as_ids=True)
    assert serving_options(parser.parse_args(["serve", "m"])) == ServingOptions()
