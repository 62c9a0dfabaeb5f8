"""Speculative decoding behind the OpenAI server: concurrent streams with a draft model give
the offline greedy output, /metrics counts drafts and accepted tokens, and a client that
hangs up mid-stream (drafts in flight) gets every KV block and its draft state freed."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from tests.server.conftest import RunningServer, start_server, stream_completions
from tokenmill import LLM, SamplingParams
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.spec_decode.policy import DRAFT_MODEL_COST, VERIFY_COST_PER_DRAFT, SpecCosts

SELF_INT8 = {"method": "draft_model", "quantization": "int8", "num_speculative_tokens": 3}


@pytest.fixture(scope="module")
def spec_server(tiny_model) -> Iterator[RunningServer]:
    path, _ = tiny_model("llama")
    with pytest.MonkeyPatch.context() as mp:  # SmolLM2's costs: tests/engine/test_spec_decode
        mp.setattr("tokenmill.worker.model_runner.measure_spec_costs",
                   lambda *args: SpecCosts(VERIFY_COST_PER_DRAFT, DRAFT_MODEL_COST))
        engine = LLMEngine.from_options(path, max_model_len=512, num_kv_blocks=400,
                                        max_num_seqs=4, speculative_config=SELF_INT8)
    yield from start_server(engine, "tiny-llama")


def metric(base_url: str, name: str) -> float:
    for line in httpx.get(f"{base_url}/metrics").text.splitlines():
        if line.startswith(f"tokenmill:{name}{{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no {name} in /metrics")


def test_concurrent_streams_match_offline_greedy(spec_server, tiny_model):
    prompts = [f"Request {i}: " + "word " * (i % 7) for i in range(6)]
    lengths = [12 + 7 * i for i in range(6)]  # they finish apart: the batch shrinks to drafting

    texts = stream_completions(spec_server.base_url, "tiny-llama", prompts, lengths)
    offline = LLM(tiny_model("llama")[0], max_model_len=512)
    outs = offline.generate(prompts, [SamplingParams(temperature=0, max_tokens=n)
                                      for n in lengths], use_tqdm=False)
    assert texts == [o.outputs[0].text for o in outs]
    spec_server.wait_idle()
    drafted = metric(spec_server.base_url, "spec_decode_num_draft_tokens_total")
    accepted = metric(spec_server.base_url, "spec_decode_num_accepted_tokens_total")
    # each request's first token comes from its prefill, every other one may be a draft; the
    # int8 self-draft agrees with its float32 target on most of them
    assert 0 < accepted <= min(drafted, sum(lengths) - len(prompts))
    assert accepted / drafted >= 0.5, (accepted, drafted)


def test_disconnect_mid_draft_frees_blocks_and_draft_state(spec_server):
    body = {"model": "tiny-llama", "prompt": "x " * 50, "max_tokens": 400, "temperature": 0.7,
            "seed": 5, "ignore_eos": True, "stream": True}
    drafter = spec_server.engine.runner.drafter
    with httpx.stream("POST", f"{spec_server.base_url}/v1/completions", json=body,
                      timeout=30) as r:
        lines = r.iter_lines()
        got = [next(lines) for _ in range(12)]
        assert any(line.startswith("data: ") for line in got)
        assert drafter._states  # the draft model is drafting for it,
        assert drafter.sampler._generators  # sampling its drafts from its own seeded stream
    spec_server.wait_idle()
    # the abort reaches the runner with the next step
    after = httpx.post(f"{spec_server.base_url}/v1/completions", timeout=30, json={
        "model": "tiny-llama", "prompt": "y", "max_tokens": 2, "temperature": 0})
    assert after.status_code == 200
    spec_server.wait_idle()
    assert drafter._states == {} and drafter.sampler._generators == {}
