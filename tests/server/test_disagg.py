"""Disaggregated prefill / decode through `tokenmill proxy`: a producer server computes each
prompt and writes its KV to shared storage, a consumer server loads it and decodes; the client
sees one server's tokens, streamed or not, and the consumer computes almost none of the
prompt. A failed prefill falls back to computing the prompt; a refused one is the client's
error."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import httpx
import openai
import pytest
import uvicorn

from tests.server.conftest import free_port, start_server, stream_completions
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.server.disagg_proxy import build_proxy_app, prefill_body

PROMPTS = [" ".join(f"w{i * 7 + j}" for j in range(60 + 9 * i)) for i in range(4)]
LENGTHS = [8, 5, 9, 6]


def _transfer(role: str, directory) -> dict:
    return {"kv_connector": "SharedStorageConnector", "kv_role": role,
            "kv_connector_extra_config": {"shared_storage_path": str(directory)}}


def _engine(path: str, **options) -> LLMEngine:
    return LLMEngine.from_options(path, max_model_len=512, num_kv_blocks=200, **options)


def serve_proxy(prefill: list[str], decode: list[str], app_out: list | None = None
                ) -> Iterator[str]:
    """`tokenmill proxy`'s app on a thread; its URL (the app appended to `app_out`)."""
    port = free_port()
    app = build_proxy_app(prefill, decode)
    if app_out is not None:
        app_out.append(app)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port,
                                           log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "proxy did not start"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)


@pytest.fixture(scope="module")
def deployment(tiny_model, tmp_path_factory):
    path, _ = tiny_model("llama")
    shared = tmp_path_factory.mktemp("kv_shared")
    servers = [start_server(_engine(path, kv_transfer_config=_transfer(role, shared)),
                            "tiny-llama") for role in ("kv_producer", "kv_consumer")]
    single = start_server(_engine(path), "tiny-llama")
    producer, consumer, alone = next(servers[0]), next(servers[1]), next(single)
    proxy_gen = serve_proxy([producer.base_url], [consumer.base_url])
    proxy = next(proxy_gen)
    yield proxy, producer, consumer, alone
    for gen in (proxy_gen, *servers, single):
        gen.close()


def test_prefill_body_asks_for_one_token():
    body = {"prompt": "x", "max_tokens": 50, "stream": True, "n": 3,
            "stream_options": {"include_usage": True}}
    assert prefill_body(body) == {"prompt": "x", "max_tokens": 1, "stream": False}
    assert prefill_body({"messages": [], "max_completion_tokens": 9})[
        "max_completion_tokens"] == 1


def test_streamed_answers_equal_one_servers(deployment):
    proxy, producer, consumer, alone = deployment
    before = consumer.engine.stats().num_prompt_tokens_computed
    got = stream_completions(proxy, "tiny-llama", PROMPTS, LENGTHS)
    assert got == stream_completions(alone.base_url, "tiny-llama", PROMPTS, LENGTHS)
    computed = consumer.engine.stats().num_prompt_tokens_computed - before
    prompt_tokens = producer.engine.stats().prefix_cache_queries
    assert computed <= len(PROMPTS) * 16 < prompt_tokens / 4  # only each prompt's tail
    consumer.wait_idle()


def test_chat_without_streaming(deployment):
    proxy, _, consumer, alone = deployment
    messages = [{"role": "user", "content": PROMPTS[2]}]

    def ask(url: str) -> str:
        with openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0) as client:
            r = client.chat.completions.create(model="tiny-llama", messages=messages,
                                               max_tokens=7, temperature=0)
        return r.choices[0].message.content

    hits = dict(consumer.engine.kv.offload.hit_tokens)
    assert ask(proxy) == ask(alone.base_url)
    assert consumer.engine.kv.offload.hit_tokens["shared"] > hits.get("shared", 0)


def test_a_failed_prefill_falls_back_to_the_decode_instance(deployment):
    _, _, consumer, alone = deployment
    apps: list = []
    gen = serve_proxy([f"http://127.0.0.1:{free_port()}"], [consumer.base_url], apps)  # nobody
    proxy = next(gen)
    try:
        prompts = [p + " again" for p in PROMPTS[:2]]
        assert (stream_completions(proxy, "tiny-llama", prompts, [4, 4])
                == stream_completions(alone.base_url, "tiny-llama", prompts, [4, 4]))
        assert apps[0].state.proxy.prefill_failures == 2
    finally:
        gen.close()


def test_a_refused_request_is_the_clients_error(deployment):
    proxy, _, _, _ = deployment
    r = httpx.post(f"{proxy}/v1/completions", json={"model": "tiny-llama", "prompt": "x",
                                                     "temperature": -1})
    assert r.status_code == 400 and "temperature" in r.json()["error"]["message"]
    r = httpx.post(f"{proxy}/v1/completions", content=b"{not json")
    assert r.status_code == 400
    assert httpx.get(f"{proxy}/health").status_code == 200
    assert httpx.get(f"{proxy}/v1/models").json()["data"][0]["id"] == "tiny-llama"


def _launch(args: list[str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "tokenmill", *args],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def _wait_healthy(url: str, proc: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise AssertionError(f"{url} did not come up")


def _metric(url: str, name: str) -> float:
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no {name} in {url}/metrics")


@pytest.mark.slow
def test_three_processes_give_one_servers_tokens(deployment, tiny_model, tmp_path):
    """Producer, consumer and proxy as `tokenmill serve` / `tokenmill proxy` processes."""
    path, _ = tiny_model("llama")
    _, _, _, alone = deployment
    ports = [free_port() for _ in range(3)]
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    common = [path, "--max-model-len", "512", "--num-kv-blocks", "200",
              "--served-model-name", "tiny-llama", "--host", "127.0.0.1"]
    procs = [_launch(["serve", *common, "--port", str(ports[i]), "--kv-transfer-config",
                      json.dumps(_transfer(role, tmp_path))])
             for i, role in enumerate(("kv_producer", "kv_consumer"))]
    procs.append(_launch(["proxy", "--port", str(ports[2]), "--prefill", urls[0],
                          "--decode", urls[1]]))
    try:
        for url, proc in zip(urls, procs, strict=True):
            _wait_healthy(url, proc)
        got = stream_completions(urls[2], "tiny-llama", PROMPTS, LENGTHS)
        assert got == stream_completions(alone.base_url, "tiny-llama", PROMPTS, LENGTHS)
        computed = _metric(urls[1], "tokenmill:prompt_tokens_computed_total")
        assert computed <= len(PROMPTS) * 16
        assert _metric(urls[1], "tokenmill:kv_offload_hit_tokens_total") > 4 * computed
        assert _metric(urls[0], "tokenmill:kv_offload_blocks_stored_total") > 0
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(timeout=60)


def test_health_says_when_the_disk_tier_is_off(tiny_model, tmp_path, monkeypatch):
    def full(*_):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("tokenmill.kv_offload.file_store.write_block", full)
    path, _ = tiny_model("llama")
    engine = LLMEngine.from_options(path, max_model_len=512, num_kv_blocks=24,
                                    kv_offloading_size=1, kv_offloading_dir=str(tmp_path))
    gen = start_server(engine, "tiny-llama")
    server = next(gen)
    try:
        assert httpx.get(f"{server.base_url}/health").status_code == 200
        assert httpx.get(f"{server.base_url}/health").content == b""
        stream_completions(server.base_url, "tiny-llama", PROMPTS, LENGTHS)  # evicts
        r = httpx.get(f"{server.base_url}/health")
        assert r.status_code == 200 and r.json()["status"] == "degraded"
        assert "tokenmill:kv_offload_disk_available" in httpx.get(
            f"{server.base_url}/metrics").text
    finally:
        gen.close()
