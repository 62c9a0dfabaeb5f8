"""The overload benchmark: 40 simultaneous requests against a server admitting 4 + 4
sequences (the surplus gets 429 with Retry-After, every admitted request completes, /health
was probed throughout), and 1,000 connections at once against `tokenmill serve`."""

from __future__ import annotations

import asyncio

import pytest

from tests.server.conftest import start_server
from tokenmill.bench.overload import format_result, overload
from tokenmill.bench.serve_command import launch
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.server.api_server import ServerLimits


def test_overload_run(tiny_model):
    path, _ = tiny_model("llama")
    engine = LLMEngine.from_options(path, max_model_len=512, num_kv_blocks=200, max_num_seqs=4)
    for srv in start_server(engine, "m", limits=ServerLimits(max_waiting_requests=4)):
        r = asyncio.run(overload(srv.base_url, 40, max_tokens=64))
        assert set(r.statuses) == {200, 429}
        assert 8 <= r.statuses[200] < 40 and r.statuses[200] + r.statuses[429] == 40
        assert r.retry_after == {"1"} and r.health_s
        assert "queue bound 4" in format_result(r, 40, 4)
        srv.wait_idle()


@pytest.mark.slow
def test_a_thousand_connections_at_once_all_get_answers_and_health_stays_fast(smollm2_path):
    """`tokenmill serve` (its own process) on the default model, 1,000 completions sent at
    once, each on a connection of its own, their prompts long enough that prefill steps keep
    the engine busy: every connection gets a 200 or a 429 (OpenAI's error shape, Retry-After),
    none is closed unanswered, and /health, probed from a process of its own, answers within
    2 s throughout (the kernels held the GIL: it once waited seconds behind a prefill step)."""
    proc, base = launch(smollm2_path, ("--max-num-seqs", "16", "--max-waiting-requests", "16",
                                       "--kv-cache-memory", "512MiB"))
    try:
        r = asyncio.run(overload(base, 1000, max_tokens=4, prompt_words=150))
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    assert set(r.statuses) == {200, 429}, r.statuses
    assert r.statuses[200] >= 32 and sum(r.statuses.values()) == 1000
    assert r.retry_after == {"1"}
    assert len(r.health_s) > 10 and max(r.health_s) < 2.0, format_result(r, 1000, 16)
