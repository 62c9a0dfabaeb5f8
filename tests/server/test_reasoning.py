"""--reasoning-parser on a running server: a chat answer's reasoning comes back in
`message.reasoning` (streamed as `delta.reasoning`), its content without it; a request's
include_reasoning false drops it. The tiny model is made to answer with tags by a choice
constraint applied from the first token (enable_in_reasoning: what it writes is then
known)."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from tests.server.conftest import start_server
from tokenmill.engine.llm_engine import LLMEngine

THOUGHT = "<think>Paris is the capital.</think>It is Paris."
ASK = {"messages": [{"role": "user", "content": "Capital of France?"}], "temperature": 0,
       "guided_choice": [THOUGHT], "max_tokens": 64}


@pytest.fixture(scope="module")
def server(tiny_model):
    engine = LLMEngine.from_options(tiny_model("llama")[0], max_model_len=512, num_kv_blocks=96,
                                    reasoning_parser="deepseek_r1",
                                    structured_outputs_config={"enable_in_reasoning": True})
    yield from start_server(engine, "m")


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


def _client(srv) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{srv.base_url}/v1", api_key="x", max_retries=0)


def _responses(srv, stream: bool = False, **extra):
    return _client(srv).responses.create(
        model="m", input="Capital of France?", temperature=0, max_output_tokens=64,
        stream=stream, extra_body={"structured_outputs": {"choice": [THOUGHT]}, **extra})


def test_responses_answer_with_a_reasoning_item_then_the_message(server):
    r = _responses(server)
    assert [item.type for item in r.output] == ["reasoning", "message"]
    assert r.output[0].content[0].text == "Paris is the capital." and r.output[0].summary == []
    assert r.output_text == "It is Paris."
    tok = server.engine.tokenizer
    through_end = len(tok.encode("<think>Paris is the capital.</think>",
                                 add_special_tokens=False))
    assert r.usage.output_tokens_details.reasoning_tokens == through_end
    assert r.usage.output_tokens > through_end
    hidden = _responses(server, include_reasoning=False)
    assert [item.type for item in hidden.output] == ["message"]
    server.wait_idle()


def test_a_responses_stream_closes_the_reasoning_before_the_message(server):
    events = list(_responses(server, stream=True))
    kinds = [e.type for e in events]
    thought = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    said = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert (thought, said) == ("Paris is the capital.", "It is Paris.")
    done = kinds.index("response.reasoning_text.done")
    assert done < kinds.index("response.output_text.delta")
    assert kinds.count("response.output_item.added") == kinds.count("response.output_item.done")
    final = events[-1].response
    assert [item.type for item in final.output] == ["reasoning", "message"]
    assert [e.output_index for e in events if e.type == "response.output_item.done"] == [0, 1]
    server.wait_idle()


def test_reasoning_items_go_back_with_their_turn(server):
    first = _responses(server)
    follow = [*[item.model_dump(exclude_none=True) for item in first.output],
              {"role": "user", "content": "And of Italy?"}]
    client = _client(server)
    again = client.responses.create(model="m", input=follow, max_output_tokens=4)
    without = client.responses.create(model="m", input=follow[1:], max_output_tokens=4)
    # accepted; SmolLM2's template shows no reasoning (test_thinking_apis.py: one that does)
    assert again.usage.input_tokens == without.usage.input_tokens
    r = httpx.post(f"{server.base_url}/v1/responses", json={"model": "m", "input": [
        follow[0]]})
    assert r.status_code == 400 and "reasoning item" in r.json()["error"]["message"]
    server.wait_idle()


def test_chat_usage_counts_the_reasoning_tokens(server, tiny_server):
    tok = server.engine.tokenizer
    through_end = len(tok.encode("<think>Paris is the capital.</think>",
                                 add_special_tokens=False))
    r = httpx.post(f"{server.base_url}/v1/chat/completions", timeout=60,
                   json={"model": "m", **ASK}).json()
    assert r["usage"]["completion_tokens_details"] == {"reasoning_tokens": through_end}
    last = None
    with httpx.stream("POST", f"{server.base_url}/v1/chat/completions", timeout=60, json={
            "model": "m", **ASK, "stream": True, "stream_options": {"include_usage": True}}) as s:
        for line in s.iter_lines():
            if line.startswith("data: {"):
                last = json.loads(line[6:])
    assert last["usage"]["completion_tokens_details"] == {"reasoning_tokens": through_end}
    plain = httpx.post(f"{tiny_server.base_url}/v1/chat/completions", timeout=60,
                       json={"model": tiny_server.model, **ASK}).json()
    assert plain["usage"]["completion_tokens_details"] is None  # no parser: vLLM's null
    server.wait_idle()
