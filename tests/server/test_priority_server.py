"""The `priority` request field (vLLM's extra): served under --scheduling-policy priority,
refused by name in OpenAI's error shape where it would mean nothing or is not an integer."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.server.conftest import start_server
from tokenmill.engine.llm_engine import LLMEngine


@pytest.fixture(scope="module")
def priority_server(tiny_model):
    path, _ = tiny_model("llama")
    engine = LLMEngine.from_options(path, max_model_len=512, num_kv_blocks=200,
                                    scheduling_policy="priority")
    yield from start_server(engine, "tiny-llama")


def test_priority_is_served(priority_server):
    with openai.OpenAI(base_url=f"{priority_server.base_url}/v1", api_key="x",
                       max_retries=0) as client:
        r = client.completions.create(model="tiny-llama", prompt="hello", max_tokens=3,
                                      extra_body={"priority": -5})
        assert r.choices[0].finish_reason == "length"
        c = client.chat.completions.create(
            model="tiny-llama", messages=[{"role": "user", "content": "hi"}], max_tokens=3,
            extra_body={"priority": 7})
        assert c.choices[0].message.content is not None
    r = httpx.post(f"{priority_server.base_url}/v1/completions",
                   json={"model": "tiny-llama", "prompt": "x", "priority": "high"})
    assert r.status_code == 400 and "priority" in r.json()["error"]["message"]


def test_priority_without_the_policy_is_a_400(tiny_server):
    r = httpx.post(f"{tiny_server.base_url}/v1/completions",
                   json={"model": "tiny-llama", "prompt": "x", "max_tokens": 2, "priority": 1})
    assert r.status_code == 400
    assert "priority scheduling policy" in r.json()["error"]["message"]
    r = httpx.post(f"{tiny_server.base_url}/v1/completions",
                   json={"model": "tiny-llama", "prompt": "x", "max_tokens": 2, "priority": 0})
    assert r.status_code == 200
    tiny_server.wait_idle()
