"""Data parallelism behind one API server (engine/data_parallel.py, engine/dp_router.py): two
engine replicas, each with its own worker process and KV cache, answer concurrent openai-client
requests with the greedy text one engine gives; a shared-prefix workload gets more prefix-cache
hits from the cache-aware router than from round robin; a replica that dies takes the server
down with exit code 1 and /health 503, leaving no process."""

from __future__ import annotations

import os
import random
import re
import signal
import time

import httpx
import openai
import pytest

from tests.conftest import no_workers_left
from tests.server.conftest import start_server, stream_completions
from tokenmill import LLM, SamplingParams
from tokenmill.engine.data_parallel import DataParallelLLM, make_replicas
from tokenmill.engine_args import EngineArgs

OPTIONS = dict(max_model_len=512, num_kv_blocks=200, block_size=16)


def metric(base_url: str, name: str) -> float:
    text = httpx.get(f"{base_url}/metrics", timeout=10).text
    return float(re.search(rf"^{re.escape(name)}\{{[^}}]*\}} (\S+)$", text, re.M).group(1))


def test_two_replicas_answer_concurrent_openai_requests(tiny_model):
    path, _ = tiny_model("llama")
    prompts = [f"Request number {i}: tell me about the number {i * 7}." for i in range(10)]
    lengths = [8 + i % 5 for i in range(10)]
    ref = LLM(path, **OPTIONS)
    expected = [o.outputs[0].text for o in ref.generate(
        prompts, [SamplingParams(temperature=0, max_tokens=n) for n in lengths],
        use_tqdm=False)]
    ref.engine.shutdown()
    engines = make_replicas(EngineArgs.from_options(path, data_parallel_size=2, **OPTIONS))
    assert [len(e.executor.procs) for e in engines] == [1, 1]  # each replica's own process
    for srv in start_server(engines, "tiny-llama"):
        assert isinstance(srv.server.lifecycle.async_llm, DataParallelLLM)
        assert stream_completions(srv.base_url, "tiny-llama", prompts, lengths) == expected
        srv.wait_idle()
        # both replicas served, and the metrics are of both
        computed = [e.scheduler.num_prompt_tokens_computed for e in engines]
        assert all(c > 0 for c in computed), computed
        assert metric(srv.base_url, "tokenmill:request_success_total") == 10
        assert metric(srv.base_url, "tokenmill:num_requests_running") == 0
        assert metric(srv.base_url, "tokenmill:kv_cache_capacity_tokens") == 2 * 199 * 16
    assert no_workers_left()


def _shared_prefix_hits(path: str, router: str) -> tuple[float, list[int]]:
    """3 groups of 4 prompts, each group sharing a 96-token prefix, sent one after another,
    the groups interleaved; the prefix-cache hits of both replicas together."""
    rng = random.Random(0)
    prefixes = [[rng.randrange(100, 40000) for _ in range(96)] for _ in range(3)]
    prompts = [prefixes[i % 3] + [rng.randrange(100, 40000) for _ in range(8)]
               for i in range(12)]
    engines = make_replicas(EngineArgs.from_options(path, data_parallel_size=2, **OPTIONS))
    for srv in start_server(engines, "tiny-llama", data_parallel_router=router):
        with openai.OpenAI(base_url=f"{srv.base_url}/v1", api_key="x") as client:
            for p in prompts:
                client.completions.create(model="tiny-llama", prompt=p, max_tokens=2)
        srv.wait_idle()
        hits = metric(srv.base_url, "tokenmill:prefix_cache_hits_total")
        served = [e.scheduler.num_prompt_tokens_computed for e in engines]
    return hits, served


@pytest.mark.slow
def test_cache_aware_router_hits_the_prefix_cache_more_than_round_robin(tiny_model):
    path, _ = tiny_model("llama")
    aware, aware_served = _shared_prefix_hits(path, "cache_aware")
    rr, rr_served = _shared_prefix_hits(path, "round_robin")
    print(f"\nshared-prefix workload, prefix-cache hits (tokens): cache_aware {aware:.0f}, "
          f"round_robin {rr:.0f}; prompt tokens computed per replica: {aware_served} vs "
          f"{rr_served}")
    # cache_aware: each group's prefix computed once (3 of 4 prompts hit its 96 tokens);
    # round robin: each group's prompts alternate between the replicas (2 of 4 hit)
    assert aware == 3 * 3 * 96
    assert rr == 3 * 2 * 96
    assert sum(aware_served) < sum(rr_served)


@pytest.mark.slow
def test_a_replica_that_dies_takes_the_server_down(tiny_model):
    path, _ = tiny_model("llama")
    engines = make_replicas(EngineArgs.from_options(path, data_parallel_size=2, **OPTIONS))
    victim = engines[1].executor.procs[0]
    for srv in start_server(engines, "tiny-llama"):
        assert httpx.get(f"{srv.base_url}/health", timeout=5).status_code == 200
        os.kill(victim.pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while (health := httpx.get(f"{srv.base_url}/health", timeout=5)).status_code == 200:
            assert time.monotonic() < deadline
            time.sleep(0.1)
        assert health.status_code == 503 and "rank 0" in health.json()["error"]["message"]
        srv.thread.join(timeout=30)
        assert not srv.thread.is_alive() and srv.server.lifecycle.exit_code == 1
    assert no_workers_left()


def test_offline_llm_and_in_process_replicas_are_refused(tiny_model):
    path, _ = tiny_model("llama")
    with pytest.raises(ValueError, match="tokenmill serve --data-parallel-size"):
        LLM(path, data_parallel_size=2)
    with pytest.raises(ValueError, match="each replica's model in worker processes"):
        make_replicas(EngineArgs.from_options(path, data_parallel_size=2,
                                           distributed_executor_backend="uni"))
    assert no_workers_left()
