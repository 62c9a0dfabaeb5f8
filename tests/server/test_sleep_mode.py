"""Sleep mode (vLLM's routes): POST /sleep?level=1|2 releases the runner's KV cache and weights,
generation answers 503 in OpenAI's shape while /health stays 200 and says "sleeping", POST
/wake_up brings them back and the answers are those from before; the routes are 404 without
--enable-sleep-mode; offline LLM.sleep / wake_up likewise."""

from __future__ import annotations

import httpx
import pytest

from tests.server.conftest import start_server
from tokenmill import LLM, SamplingParams
from tokenmill.engine.llm_engine import LLMEngine

BODY = {"model": "tiny-llama", "prompt": "the sleeping engine", "max_tokens": 8,
        "temperature": 0}


@pytest.fixture(scope="module")
def sleepy_server(tiny_model):
    path, _ = tiny_model("llama")
    engine = LLMEngine.from_options(path, max_model_len=512, num_kv_blocks=64,
                                    enable_sleep_mode=True)
    yield from start_server(engine, "tiny-llama")


def _complete(url: str) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", json=BODY, timeout=60)


@pytest.mark.parametrize("level", [1, 2])
def test_sleep_and_wake_keep_the_answers(sleepy_server, level):
    url, runner = sleepy_server.base_url, sleepy_server.engine.runner
    before = _complete(url).json()["choices"][0]["text"]
    assert httpx.post(f"{url}/sleep", params={"level": level}).status_code == 200
    assert httpx.get(f"{url}/is_sleeping").json() == {"is_sleeping": True}
    assert runner.model is None and runner.kv_cache is None  # released
    asleep = _complete(url)
    assert asleep.status_code == 503 and "asleep" in asleep.json()["error"]["message"]
    health = httpx.get(f"{url}/health")
    assert health.status_code == 200 and health.json()["status"] == "sleeping"
    assert httpx.post(f"{url}/wake_up").status_code == 200
    assert httpx.get(f"{url}/is_sleeping").json() == {"is_sleeping": False}
    assert _complete(url).json()["choices"][0]["text"] == before
    assert httpx.get(f"{url}/health").content == b""
    sleepy_server.wait_idle()


def test_bad_levels_and_a_server_without_sleep_mode(sleepy_server, tiny_server):
    r = httpx.post(f"{sleepy_server.base_url}/sleep", params={"level": 3})
    assert r.status_code == 400 and "level" in r.json()["error"]["message"]
    assert httpx.post(f"{sleepy_server.base_url}/wake_up").status_code == 200  # awake: no-op
    assert httpx.post(f"{tiny_server.base_url}/sleep").status_code == 404


def test_offline_sleep_and_wake(tiny_model):
    path, _ = tiny_model("llama")
    params = SamplingParams(temperature=0, max_tokens=8)
    llm = LLM(path, enable_sleep_mode=True, kv_offloading_size="16MiB")
    before = llm.generate([[5, 6, 7, 8]], params, use_tqdm=False)[0].outputs[0].token_ids
    llm.sleep(level=2)
    with pytest.raises(RuntimeError, match="asleep"):
        llm.generate([[5, 6, 7, 8]], params, use_tqdm=False)
    llm.wake_up()
    after = llm.generate([[5, 6, 7, 8]], params, use_tqdm=False)[0].outputs[0].token_ids
    assert before == after
    with pytest.raises(ValueError, match="sleep mode is off"):
        LLM(path).sleep()
