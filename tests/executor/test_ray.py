"""The Ray executor (executor/ray_executor.py) against a local Ray instance the test starts,
bound to 127.0.0.1: TP=2 and PP=2 greedy output identical to Hugging Face (the ranks are Ray
actors in a placement group; gloo and the shared-memory all-reduce between them); a killed
actor fails the engine at once; a dead actor is seen while the engine idles; more ranks than
the cluster has CPUs fail in seconds, naming what is missing (tests/executor/test_ray_owned.py:
an instance the engine starts itself)."""

from __future__ import annotations

import time

import pytest

from tests.conftest import generate_greedy, hf_greedy, mixed_prompts
from tokenmill import LLM, SamplingParams
from tokenmill.engine.llm_engine import EngineDeadError, LLMEngine

ray = pytest.importorskip("ray")


@pytest.fixture(scope="module")
def local_ray():
    ray.init(address="local", _node_ip_address="127.0.0.1", num_cpus=2,
             include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.mark.parametrize(("tp", "pp"), [(2, 1), (1, 2)])
def test_two_ranks_on_ray_are_identical_to_hf(local_ray, tiny_model, tp, pp):
    """TP=2 (heads split), PP=2 (two stages, steps in flight through the actors' queues)."""
    path, hf = tiny_model("llama")
    cases = mixed_prompts(6, 49152, seed=5, max_len=100, max_new=16)
    llm = LLM(path, tensor_parallel_size=tp, pipeline_parallel_size=pp,
              distributed_executor_backend="ray", num_kv_blocks=64, block_size=8,
              max_num_batched_tokens=64)
    try:
        got = generate_greedy(llm, cases)
        assert len(ray.get([a.ping.remote() for a in llm.engine.executor.actors])) == 2
    finally:
        llm.engine.shutdown()
    assert got == [hf_greedy(hf, p, m) for p, m in cases]


def test_a_killed_actor_fails_the_engine(local_ray, tiny_model):
    path, _ = tiny_model("llama")
    engine = LLMEngine.from_options(path, tensor_parallel_size=2,
                                    distributed_executor_backend="ray", num_kv_blocks=64)
    try:
        engine.add_request("a", [5, 6, 7], SamplingParams(max_tokens=100, ignore_eos=True))
        engine.step()
        ray.kill(engine.executor.actors[1])
        with pytest.raises(EngineDeadError, match="rank 1 died"):
            for _ in range(100):
                engine.step()
    finally:
        engine.shutdown()


def test_a_dead_actor_is_seen_while_idle(local_ray, tiny_model):
    path, _ = tiny_model("llama")
    engine = LLMEngine.from_options(path, tensor_parallel_size=2,
                                    distributed_executor_backend="ray", num_kv_blocks=64)
    engine.check_health()
    ray.kill(engine.executor.actors[0])  # asynchronous: a ping may still be answered
    deadline = time.monotonic() + 10
    with pytest.raises(EngineDeadError, match="Ray worker is gone"):
        while time.monotonic() < deadline:
            engine.check_health()
            time.sleep(0.1)
    engine.shutdown()


def test_more_ranks_than_the_cluster_has_cpus_fail_at_once(local_ray, tiny_model):
    """TP=2 x PP=2 = 4 ranks on the test's 2-CPU instance: refused in seconds (it waited ten
    minutes for its placement group, then raised GetTimeoutError), its placement group gone."""
    path, _ = tiny_model("llama")
    t0 = time.monotonic()
    with pytest.raises(ValueError, match=r"4 ranks .* need 4 CPUs, one per rank; the Ray "
                                         r"cluster has 2 CPUs in all \(2 free\)"):
        LLM(path, tensor_parallel_size=2, pipeline_parallel_size=2,
            distributed_executor_backend="ray", num_kv_blocks=64)
    assert time.monotonic() - t0 < 30
    assert ray.available_resources().get("CPU") == 2  # nothing held
    assert ray.is_initialized()  # the caller's instance stays
