"""The OpenAI-compatible server, driven by the official `openai` client against a real server
on 127.0.0.1: completions and chat, streaming and not, n > 1, stop, logprobs, usage; every error
status; 64 concurrent streams equal to offline output; disconnects free every KV block; metrics
move; tokenize / detokenize / health / version."""

from __future__ import annotations

import json
import socket
import time

import httpx
import openai
import pytest

from tests.server.conftest import start_server, stream_completions
from tokenmill import LLM, SamplingParams
from tokenmill.engine.llm_engine import LLMEngine

PROMPTS = ["Hello, my name is", "The quick brown fox", "1, 2, 3,", "Why is the sky blue?"]


@pytest.fixture(scope="module")
def client(tiny_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{tiny_server.base_url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def offline(tiny_model) -> LLM:
    path, _ = tiny_model("llama")
    return LLM(path, max_model_len=512)


def greedy(offline: LLM, prompt, max_tokens: int, **kw):
    params = SamplingParams(temperature=0, max_tokens=max_tokens, **kw)
    return offline.generate([prompt], params, use_tqdm=False)[0].outputs[0]


def test_models_health_version(client, tiny_server):
    models = client.models.list()
    assert [m.id for m in models.data] == ["tiny-llama"]
    assert httpx.get(f"{tiny_server.base_url}/health").status_code == 200
    # SageMaker's /ping (vLLM's too) answers as /health does
    assert httpx.get(f"{tiny_server.base_url}/ping").status_code == 200
    assert httpx.post(f"{tiny_server.base_url}/ping").status_code == 200
    assert httpx.get(f"{tiny_server.base_url}/version").json()["version"]


def test_completion_matches_offline(client, offline):
    r = client.completions.create(model="tiny-llama", prompt=PROMPTS, max_tokens=12,
                                  temperature=0)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    for prompt, choice in zip(PROMPTS, r.choices, strict=True):
        ref = greedy(offline, prompt, 12)
        assert choice.text == ref.text and choice.finish_reason == ref.finish_reason
    tok = offline.get_tokenizer()
    assert r.usage.prompt_tokens == sum(len(tok.encode(p)) for p in PROMPTS)
    assert r.usage.completion_tokens == sum(
        len(greedy(offline, p, 12).token_ids) for p in PROMPTS)
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert r.id.startswith("cmpl-") and r.created > 0 and r.model == "tiny-llama"


def test_token_id_prompt(client, offline):
    r = client.completions.create(model="tiny-llama", prompt=[5, 6, 7, 8], max_tokens=6,
                                  temperature=0)
    assert r.choices[0].text == greedy(offline, [5, 6, 7, 8], 6).text


def test_chat_matches_offline(client, offline):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    r = client.chat.completions.create(model="tiny-llama", messages=msgs, max_tokens=10,
                                       temperature=0)
    ref = offline.chat(msgs, SamplingParams(temperature=0, max_tokens=10), use_tqdm=False)[0]
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == ref.outputs[0].text
    assert r.usage.prompt_tokens == len(ref.prompt_token_ids)
    r = client.chat.completions.create(model="tiny-llama", messages=msgs,
                                       max_completion_tokens=3, temperature=0)
    assert r.usage.completion_tokens == 3 and r.choices[0].finish_reason == "length"


def test_streaming_completion(client, offline):
    stream = client.completions.create(model="tiny-llama", prompt=PROMPTS[:2], max_tokens=10,
                                       temperature=0, stream=True,
                                       stream_options={"include_usage": True})
    texts, finish, usage = {0: "", 1: ""}, {}, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            texts[c.index] += c.text
            if c.finish_reason:
                finish[c.index] = c.finish_reason
    for i, p in enumerate(PROMPTS[:2]):
        assert texts[i] == greedy(offline, p, 10).text
    assert finish == {0: "length", 1: "length"} and usage.completion_tokens == 20


def test_streaming_chat_with_n_and_usage(client):
    stream = client.chat.completions.create(
        model="tiny-llama", messages=[{"role": "user", "content": "Tell me a story"}],
        max_tokens=8, temperature=0.9, seed=3, n=2, stream=True,
        stream_options={"include_usage": True})
    chunks = list(stream)
    first = chunks[0]
    assert {c.delta.role for c in first.choices} == {"assistant"}
    texts = {0: "", 1: ""}
    for chunk in chunks[1:]:
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
    whole = client.chat.completions.create(
        model="tiny-llama", messages=[{"role": "user", "content": "Tell me a story"}],
        max_tokens=8, temperature=0.9, seed=3, n=2)
    assert [texts[0], texts[1]] == [c.message.content for c in whole.choices]
    assert chunks[-1].usage.completion_tokens == 16 and chunks[-1].choices == []


def test_streamed_logprobs_and_stops_equal_the_whole_answer(client):
    """A stream reads DELTA outputs (each step's new tokens): its pieces, logprobs and text
    offsets included, join up to the answer sent whole, for two prompts with n = 2 and a stop
    string that holds text back."""
    whole = client.completions.create(model="tiny-llama", prompt=PROMPTS[:2], max_tokens=14,
                                      temperature=0, logprobs=2, n=2, stop=["e"])
    stream = client.completions.create(model="tiny-llama", prompt=PROMPTS[:2], max_tokens=14,
                                       temperature=0, logprobs=2, n=2, stop=["e"], stream=True)
    got: dict[int, dict] = {}
    for chunk in stream:
        for c in chunk.choices:
            g = got.setdefault(c.index, {"text": "", "tokens": [], "lps": [], "offsets": []})
            g["text"] += c.text
            g["tokens"] += c.logprobs.tokens
            g["lps"] += c.logprobs.token_logprobs
            g["offsets"] += c.logprobs.text_offset
            g["finish"] = c.finish_reason
    assert sorted(got) == [0, 1, 2, 3]
    assert any(c.finish_reason == "stop" for c in whole.choices)
    for c in whole.choices:
        g = got[c.index]
        assert (g["text"], g["finish"]) == (c.text, c.finish_reason)
        assert g["tokens"] == c.logprobs.tokens and g["offsets"] == c.logprobs.text_offset
        assert g["lps"] == pytest.approx(c.logprobs.token_logprobs, abs=1e-6)
    messages = [{"role": "user", "content": "Count to ten"}]
    whole = client.chat.completions.create(model="tiny-llama", messages=messages, max_tokens=9,
                                           temperature=0, logprobs=True, top_logprobs=2)
    stream = client.chat.completions.create(model="tiny-llama", messages=messages, max_tokens=9,
                                            temperature=0, logprobs=True, top_logprobs=2,
                                            stream=True, stream_options={"include_usage": True})
    pieces, usage = [], None
    for chunk in stream:
        usage = chunk.usage or usage
        for c in chunk.choices:
            pieces += c.logprobs.content if c.logprobs is not None else []
    want = whole.choices[0].logprobs.content
    assert [p.token for p in pieces] == [p.token for p in want]
    assert [[t.token for t in p.top_logprobs] for p in pieces] == [
        [t.token for t in p.top_logprobs] for p in want]
    assert usage.completion_tokens == whole.usage.completion_tokens == 9
    assert usage.prompt_tokens == whole.usage.prompt_tokens


def test_continuous_usage_stats_count_each_choice_so_far(client):
    """vLLM's stream_options.continuous_usage_stats: every chunk carries its choice's usage so
    far (its prompt's tokens and its own), then the last chunk the whole request's."""
    stream = client.completions.create(
        model="tiny-llama", prompt=PROMPTS[:2], max_tokens=7, temperature=0, logprobs=0,
        stream=True, stream_options={"include_usage": True, "continuous_usage_stats": True})
    chunks = list(stream)
    tokens: dict[int, int] = {}
    for chunk in chunks[:-1]:
        (c,) = chunk.choices
        tokens[c.index] = tokens.get(c.index, 0) + len(c.logprobs.tokens)
        assert chunk.usage.completion_tokens == tokens[c.index]
        assert chunk.usage.total_tokens == chunk.usage.prompt_tokens + tokens[c.index]
    assert tokens == {0: 7, 1: 7}
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 14
    messages = [{"role": "user", "content": "Hi"}]
    stream = client.chat.completions.create(
        model="tiny-llama", messages=messages, max_tokens=5, temperature=0, logprobs=True,
        stream=True, stream_options={"include_usage": True, "continuous_usage_stats": True})
    chunks = list(stream)
    prompt = chunks[0].usage.prompt_tokens
    assert prompt > 0 and chunks[0].usage.completion_tokens == 0  # the role chunk
    seen = 0
    for chunk in chunks[1:-1]:
        seen += len(chunk.choices[0].logprobs.content)
        assert (chunk.usage.prompt_tokens, chunk.usage.completion_tokens) == (prompt, seen)
    assert seen == 5 and chunks[-1].usage.completion_tokens == 5
    plain = list(client.chat.completions.create(
        model="tiny-llama", messages=messages, max_tokens=5, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    assert all(c.usage is None for c in plain[:-1]) and plain[-1].usage.completion_tokens == 5


def test_stop_and_logprobs(client, offline):
    ref = greedy(offline, PROMPTS[0], 16)
    stop = ref.text[len(ref.text) // 2:len(ref.text) // 2 + 3]
    r = client.completions.create(model="tiny-llama", prompt=PROMPTS[0], max_tokens=16,
                                  temperature=0, stop=[stop], logprobs=3)
    c = r.choices[0]
    assert c.finish_reason == "stop" and c.text == ref.text[:ref.text.index(stop)]
    ref_lp = greedy(offline, PROMPTS[0], 4, logprobs=3)
    assert c.logprobs.token_logprobs[:4] == pytest.approx(
        [e[t].logprob for t, e in zip(ref_lp.token_ids, ref_lp.logprobs, strict=True)], abs=1e-5)
    assert all(len(top) >= 3 for top in c.logprobs.top_logprobs)
    chat = client.chat.completions.create(model="tiny-llama", temperature=0, max_tokens=4,
                                          messages=[{"role": "user", "content": "Hi"}],
                                          logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert len(content) == 4 and all(len(t.top_logprobs) == 2 for t in content)
    assert all(t.top_logprobs[0].logprob >= t.top_logprobs[1].logprob for t in content)
    assert all(t.logprob == pytest.approx(t.top_logprobs[0].logprob) for t in content)  # greedy


@pytest.mark.parametrize("kwargs, param", [
    (dict(max_tokens=0), "max_tokens"), (dict(temperature=-1), "temperature"),
    (dict(top_p=2), "top_p"), (dict(n=0), "n"), (dict(max_tokens=600), None),
    (dict(extra_body={"min_p": 3}), "min_p"), (dict(logit_bias={"99999": 1}), None),
])
def test_bad_parameters_are_400(client, tiny_server, kwargs, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny-llama", prompt="hi", **kwargs)
    body = e.value.body
    assert e.value.status_code == 400 and body["code"] == 400 and body["message"]
    assert body["type"] == "BadRequestError" and body["param"] == param
    tiny_server.wait_idle()


def test_prompt_over_context_is_400(client, tiny_server):
    with pytest.raises(openai.BadRequestError, match="max_model_len=512"):
        client.completions.create(model="tiny-llama", prompt=[7] * 510, max_tokens=5)
    with pytest.raises(openai.BadRequestError, match="messages"):
        client.chat.completions.create(model="tiny-llama", messages=[])
    tiny_server.wait_idle()


def test_malformed_json_and_unknown_model(client, tiny_server):
    r = httpx.post(f"{tiny_server.base_url}/v1/completions", content=b"{not json",
                   headers={"content-type": "application/json"})
    assert r.status_code == 400 and "malformed JSON" in r.json()["error"]["message"]
    r = httpx.post(f"{tiny_server.base_url}/v1/chat/completions", json={"messages": "nope"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="gpt-9", prompt="hi")
    assert e.value.status_code == 404 and "gpt-9" in e.value.body["message"]


def test_api_key(tiny_model):
    path, _ = tiny_model("llama")
    engine = LLMEngine.from_options(path, max_model_len=128, num_kv_blocks=32)
    for srv in start_server(engine, "keyed", api_key="s3cret"):
        bad = openai.OpenAI(base_url=f"{srv.base_url}/v1", api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError) as e:
            bad.models.list()
        assert e.value.status_code == 401
        assert httpx.get(f"{srv.base_url}/v1/models").status_code == 401  # no key at all
        good = openai.OpenAI(base_url=f"{srv.base_url}/v1", api_key="s3cret", max_retries=0)
        assert good.completions.create(model="keyed", prompt="a", max_tokens=2).choices
        assert httpx.get(f"{srv.base_url}/health").status_code == 200  # not under /v1


def test_64_concurrent_streams_match_offline(tiny_server, offline):
    prompts = [f"Request {i}: " + "word " * (i % 17) for i in range(64)]
    lengths = [4 + i % 13 for i in range(64)]

    texts = stream_completions(tiny_server.base_url, "tiny-llama", prompts, lengths)
    outs = offline.generate(prompts, [SamplingParams(temperature=0, max_tokens=n)
                                      for n in lengths], use_tqdm=False)
    assert texts == [o.outputs[0].text for o in outs]
    tiny_server.wait_idle()


def test_disconnect_mid_stream_frees_blocks(tiny_server):
    body = {"model": "tiny-llama", "prompt": "x " * 200, "max_tokens": 300, "temperature": 0,
            "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{tiny_server.base_url}/v1/completions", json=body,
                      timeout=30) as r:
        lines = r.iter_lines()
        got = [next(lines) for _ in range(3)]
        assert any(line.startswith("data: ") for line in got)
        assert tiny_server.engine.kv.num_free_blocks < tiny_server.engine.kv.num_usable_blocks
    tiny_server.wait_idle()


def generated_tokens(base_url: str) -> float:
    for line in httpx.get(f"{base_url}/metrics").text.splitlines():
        if line.startswith("tokenmill:generation_tokens_total"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError("no generation counter")


@pytest.mark.parametrize("stream", [False, True])
def test_disconnect_before_first_token_aborts(tiny_server, stream):
    """The client sends its request and hangs up at once: the request is aborted early (far
    fewer tokens generated than asked) and every block comes back."""
    host, port = tiny_server.base_url.removeprefix("http://").split(":")
    body = json.dumps({"model": "tiny-llama", "prompt": "z", "max_tokens": 500,
                       "temperature": 0, "ignore_eos": True, "stream": stream}).encode()
    before = generated_tokens(tiny_server.base_url)
    with socket.create_connection((host, int(port))) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: test\r\n"
                  b"Content-Type: application/json\r\n"
                  + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    tiny_server.wait_idle()
    assert generated_tokens(tiny_server.base_url) - before < 250


def test_metrics_move(client, tiny_server):
    def scrape() -> dict[str, float]:
        text = httpx.get(f"{tiny_server.base_url}/metrics").text
        out = {}
        for line in text.splitlines():
            if line.startswith("tokenmill:") and not line.startswith("#"):
                name, value = line.rsplit(" ", 1)
                out[name.split("{")[0]] = float(value)
        return out

    before = scrape()
    client.completions.create(model="tiny-llama", prompt=PROMPTS, max_tokens=5, temperature=0)
    time.sleep(0.2)
    after = scrape()
    assert after["tokenmill:generation_tokens_total"] - before[
        "tokenmill:generation_tokens_total"] == 20
    for name in ("tokenmill:prompt_tokens_total", "tokenmill:time_to_first_token_seconds_count",
                 "tokenmill:e2e_request_latency_seconds_count",
                 "tokenmill:request_queue_time_seconds_count",
                 "tokenmill:inter_token_latency_seconds_count",
                 "tokenmill:request_success_total"):
        assert after[name] > before.get(name, 0), name
    for gauge in ("tokenmill:num_requests_running", "tokenmill:num_requests_waiting",
                  "tokenmill:kv_cache_usage_perc", "tokenmill:num_preemptions_total"):
        assert gauge in after
    # the same prompts again: served from the prefix cache
    client.completions.create(model="tiny-llama", prompt=["x " * 40] * 2, max_tokens=2)
    time.sleep(0.2)
    final = scrape()
    assert final["tokenmill:prefix_cache_hits_total"] > after.get(
        "tokenmill:prefix_cache_hits_total", 0)
    assert 0 < final["tokenmill:prefix_cache_hit_rate"] <= 1


def test_tokenize_detokenize(tiny_server, offline):
    base = tiny_server.base_url
    r = httpx.post(f"{base}/tokenize", json={"prompt": "Hello world"}).json()
    assert r["tokens"] == offline.get_tokenizer().encode("Hello world") and r["count"] == 2
    chat = httpx.post(f"{base}/tokenize",
                      json={"messages": [{"role": "user", "content": "Hi"}]}).json()
    assert chat["tokens"][0] == 1
    assert httpx.post(f"{base}/detokenize", json={"tokens": r["tokens"]}).json() == {
        "prompt": "Hello world"}
    bad = httpx.post(f"{base}/detokenize", json={"tokens": [10**9]})
    assert bad.status_code == 400 and json.loads(bad.text)["error"]["code"] == 400


@pytest.mark.slow
def test_smollm2_server_answers(smollm2_path):
    engine = LLMEngine.from_options(smollm2_path, kv_cache_memory="256MiB")
    for srv in start_server(engine, "smollm2"):
        client = openai.OpenAI(base_url=f"{srv.base_url}/v1", api_key="x", max_retries=0)
        r = client.chat.completions.create(
            model="smollm2", temperature=0, max_tokens=32,
            messages=[{"role": "user", "content": "What is the capital of France?"}])
        assert r.choices[0].message.content == "The capital of France is Paris."
        assert r.choices[0].finish_reason == "stop"
        stream = client.chat.completions.create(
            model="smollm2", temperature=0, max_tokens=32, stream=True,
            messages=[{"role": "user", "content": "What is the capital of France?"}])
        assert "".join(c.choices[0].delta.content or "" for c in stream
                       if c.choices) == "The capital of France is Paris."
        srv.wait_idle()


@pytest.mark.parametrize("sig", ["SIGTERM", pytest.param("SIGINT", marks=pytest.mark.slow)])
def test_graceful_shutdown(tiny_model, sig, tmp_path):
    """`tokenmill serve` on a signal: the request in flight still gets its whole answer
    within the drain timeout, the process exits 0, and its port is closed after. It runs on
    uvloop and httptools."""
    import signal
    import threading

    from tokenmill.bench.serve_command import launch

    path, _ = tiny_model("llama")
    log = tmp_path / "stderr.log"
    with open(log, "w") as f:
        proc, base = launch(path, ("--max-model-len", "512", "--num-kv-blocks", "64"), stderr=f)
    try:
        result = {}

        def long_request() -> None:
            result["r"] = httpx.post(f"{base}/v1/completions", timeout=60, json={
                "prompt": "a", "max_tokens": 400, "temperature": 0, "ignore_eos": True})

        t = threading.Thread(target=long_request)
        t.start()
        time.sleep(0.3)  # the request is in flight
        proc.send_signal(getattr(signal, sig))
        t.join(timeout=60)
        assert proc.wait(timeout=60) == 0, log.read_text()
        # uvicorn served it with the fast loop and parser, which are dependencies
        assert "event loop uvloop, HTTP protocol HttpToolsProtocol" in log.read_text()
        r = result["r"]
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 400
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"{base}/health", timeout=1)
    finally:
        if proc.poll() is None:
            proc.kill()
