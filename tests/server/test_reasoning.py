"""--reasoning-parser on a running server: a chat answer's reasoning comes back in
`message.reasoning` (streamed as `delta.reasoning`), its content without it; a request's
include_reasoning false drops it. The tiny model is made to answer with tags by a choice
constraint (what it writes is then known)."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.server.conftest import start_server
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.server.serving_common import ServingOptions

THOUGHT = "<think>Paris is the capital.</think>It is Paris."
ASK = {"messages": [{"role": "user", "content": "Capital of France?"}], "temperature": 0,
       "guided_choice": [THOUGHT], "max_tokens": 64}


@pytest.fixture(scope="module")
def server(tiny_model):
    engine = LLMEngine.from_options(tiny_model("llama")[0], max_model_len=512, num_kv_blocks=96)
    yield from start_server(engine, "m", answers=ServingOptions(reasoning_parser="deepseek_r1"))


def _chat(srv, **fields) -> dict:
    r = httpx.post(f"{srv.base_url}/v1/chat/completions", timeout=60,
                   json={"model": "m", **ASK, **fields})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]


def test_the_reasoning_is_split_off(server):
    message = _chat(server)
    assert message["reasoning"] == "Paris is the capital."
    assert message["content"] == "It is Paris."
    hidden = _chat(server, include_reasoning=False)
    assert "reasoning" not in hidden and hidden["content"] == "It is Paris."
    server.wait_idle()


def test_a_stream_sends_the_reasoning_then_the_content(server):
    reasoning, content, order = "", "", []
    with httpx.stream("POST", f"{server.base_url}/v1/chat/completions", timeout=60,
                      json={"model": "m", "stream": True, **ASK}) as r:
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            for c in json.loads(line[6:])["choices"]:
                if c["delta"].get("reasoning"):
                    reasoning += c["delta"]["reasoning"]
                    order.append("r")
                if c["delta"].get("content"):
                    content += c["delta"]["content"]
                    order.append("c")
    assert (reasoning, content) == ("Paris is the capital.", "It is Paris.")
    assert "cr" not in "".join(order) and order  # all the reasoning, then the content
    server.wait_idle()


def test_without_a_parser_the_tags_stay_in_the_content(tiny_server):
    r = httpx.post(f"{tiny_server.base_url}/v1/chat/completions", timeout=60,
                   json={"model": tiny_server.model, **ASK}).json()
    message = r["choices"][0]["message"]
    assert message["content"] == THOUGHT and "reasoning" not in message
    tiny_server.wait_idle()
