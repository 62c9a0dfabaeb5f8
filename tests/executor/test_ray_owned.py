"""A Ray instance the engine starts itself (no cluster running, none given): it declares as many
CPUs as the ranks need, so 4 ranks share this 2-core machine as the mp executor's processes
would, and it is shut down with the engine, its processes with it."""

from __future__ import annotations

import pytest

from tests.conftest import generate_greedy, hf_greedy, mixed_prompts
from tokenmill import LLM

ray = pytest.importorskip("ray")


@pytest.mark.slow
def test_an_engine_started_ray_fits_its_ranks_and_goes_with_it(tiny_model, monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert not ray.is_initialized()
    path, hf = tiny_model("llama")
    cases = mixed_prompts(3, 49152, seed=8, max_len=40, max_new=6)
    llm = LLM(path, tensor_parallel_size=2, pipeline_parallel_size=2,
              distributed_executor_backend="ray", num_kv_blocks=64, block_size=8)
    try:
        assert ray.cluster_resources()["CPU"] >= 4
        got = generate_greedy(llm, cases)
    finally:
        llm.engine.shutdown()
    assert got == [hf_greedy(hf, p, m) for p, m in cases]
    assert not ray.is_initialized()  # the engine's instance went with it
