"""Tensor parallelism in worker processes (executor/multiproc.py, worker/worker_proc.py):
greedy output token-identical to one process and to Hugging Face, with chunked prefill,
prefix-cache hits and preemption on; KV heads split and replicated; logprobs that agree;
SmolLM2 split three ways; clear start-up errors; a killed worker fails the engine at once
and leaves no process behind."""

from __future__ import annotations

import multiprocessing
import os
import signal
import time

import pytest

from tests.conftest import generate_greedy, hf_greedy, mixed_prompts, no_workers_left
from tokenmill import LLM, SamplingParams
from tokenmill.engine.llm_engine import EngineDeadError, LLMEngine


@pytest.mark.parametrize("kind", ["llama", "llama-mqa-llama3rope", "qwen3"])
def test_tp2_greedy_is_identical_to_hf(tiny_model, kind):
    """llama: 2 KV heads split 1 + 1; llama-mqa: its one KV head replicated on both ranks;
    qwen3: q/k norms per head. A small cache and token budget force chunked prefill and
    preemption; prompts sent again hit the prefix cache."""
    path, hf = tiny_model(kind)
    cases = mixed_prompts(8, 49152, seed=3, max_len=120, max_new=24)
    llm = LLM(path, tensor_parallel_size=2, num_kv_blocks=40, block_size=8,
              max_num_batched_tokens=64, max_num_seqs=6)
    try:
        got = generate_greedy(llm, cases) + generate_greedy(llm, cases[-1:])
        cases += cases[-1:]  # the last one's blocks are still cached
        engine = llm.engine
        assert engine.scheduler.num_preemptions > 0 and engine.kv.prefix_hits > 0
    finally:
        llm.engine.shutdown()
    assert got == [hf_greedy(hf, p, m) for p, m in cases]
    assert no_workers_left()


def test_tp2_logprobs_agree_with_one_process(tiny_model):
    """Sampled and prompt logprobs (the LM head's shards gathered) within 1e-4 of TP=1."""
    path, _ = tiny_model("llama")
    prompt = list(range(100, 140))
    params = SamplingParams(temperature=0, max_tokens=8, logprobs=5, prompt_logprobs=3,
                            ignore_eos=True)
    results = []
    for tp in (1, 2):
        llm = LLM(path, tensor_parallel_size=tp, num_kv_blocks=64)
        results.append(llm.generate([prompt], params, use_tqdm=False)[0])
        llm.engine.shutdown()
    one, two = results
    assert one.outputs[0].token_ids == two.outputs[0].token_ids
    pairs = [*zip(one.outputs[0].logprobs, two.outputs[0].logprobs, strict=True),
             *zip(one.prompt_logprobs[1:], two.prompt_logprobs[1:], strict=True)]
    assert len(pairs) == 8 + 39
    for a, b in pairs:
        assert list(a) == list(b)  # the same top tokens, in the same order
        for t in a:
            assert abs(a[t].logprob - b[t].logprob) < 1e-4


@pytest.mark.slow
def test_smollm2_split_three_ways(smollm2_path):
    """SmolLM2's 9 heads and 3 KV heads over 3 ranks (one KV head each), its GGUF blocks
    sharded as they are: the chat answers of one process, token for token."""
    chats = [[{"role": "user", "content": "What is the capital of France?"}],
             [{"role": "user", "content": "Name three colours."}]]
    params = SamplingParams(temperature=0, max_tokens=24)
    answers = []
    for tp in (1, 3):
        llm = LLM(smollm2_path, tensor_parallel_size=tp, kv_cache_memory="64MiB")
        answers.append([o.outputs[0].token_ids for o in llm.chat(chats, params,
                                                                  use_tqdm=False)])
        llm.engine.shutdown()
    assert answers[0] == answers[1]
    assert no_workers_left()


@pytest.mark.parametrize(("options", "message"), [
    ({"tensor_parallel_size": 3}, "cannot split 4 attention heads / 2 KV heads"),
    ({"tensor_parallel_size": 2, "distributed_executor_backend": "uni"}, "needs 'mp'"),
    ({"pipeline_parallel_size": 0}, "pipeline_parallel_size must be an integer >= 1"),
    ({"distributed_executor_backend": "slurm"}, "must be one of uni, mp, ray"),
    ({"tensor_parallel_size": 0}, "tensor_parallel_size must be an integer >= 1"),
])
def test_bad_parallel_options_are_refused_at_start(tiny_model, options, message):
    path, _ = tiny_model("llama")
    with pytest.raises(ValueError, match=message):
        LLM(path, **options)
    assert not multiprocessing.active_children()


def test_a_worker_failing_to_start_is_reported_and_cleaned_up(tiny_model):
    path, _ = tiny_model("llama")
    with pytest.raises(RuntimeError, match="rank 0 failed to start(.|\n)*kv_cache_memory"):
        LLM(path, tensor_parallel_size=2, kv_cache_memory=1000)
    assert no_workers_left()


def test_a_killed_worker_fails_the_engine_at_once(tiny_model):
    path, _ = tiny_model("llama")
    engine = LLMEngine.from_options(path, tensor_parallel_size=2, num_kv_blocks=64)
    try:
        engine.add_request("a", [5, 6, 7], SamplingParams(max_tokens=100, ignore_eos=True))
        engine.step()
        engine.step()
        victim = engine.executor.procs[1]
        os.kill(victim.pid, signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(EngineDeadError, match=r"rank 1 \(pid \d+\) exited with code -9"):
            for _ in range(100):
                engine.step()
        assert time.monotonic() - t0 < 10
        assert no_workers_left()  # rank 0 was stopped too
        assert not [f for f in os.listdir("/dev/shm") if f.startswith("tokenmill-")]
        with pytest.raises(EngineDeadError, match="rank 1"):
            engine.check_health()
    finally:
        engine.shutdown()


def test_a_worker_dying_while_idle_is_seen_by_check_health(tiny_model):
    path, _ = tiny_model("llama")
    engine = LLMEngine.from_options(path, tensor_parallel_size=2, num_kv_blocks=64)
    engine.check_health()  # healthy
    os.kill(engine.executor.procs[0].pid, signal.SIGKILL)
    engine.executor.procs[0].join(timeout=10)
    with pytest.raises(EngineDeadError, match="rank 0"):
        engine.check_health()
    assert no_workers_left()
    engine.shutdown()
