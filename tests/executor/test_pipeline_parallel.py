"""Pipeline parallelism (--pipeline-parallel-size): the layers split into stages, one worker
process per stage (or a tensor-parallel group per stage), hidden states sent between them,
one step in flight per stage. Greedy output token-identical to Hugging Face with chunked
prefill, preemption and prefix hits; TP=2 x PP=2 in four processes; SmolLM2 split into 2 and
3 stages answers as one process does; a request that fails in the first stage or at the
driver fails alone while other steps are in flight; a killed stage fails the engine at once."""

from __future__ import annotations

import os
import signal
import time

import pytest

from tests.conftest import (
    assert_kv_all_free,
    generate_greedy,
    hf_greedy,
    mixed_prompts,
    no_workers_left,
)
from tokenmill import LLM, SamplingParams
from tokenmill.engine.llm_engine import EngineDeadError, LLMEngine

SMALL = dict(num_kv_blocks=40, block_size=8, max_num_batched_tokens=64, max_num_seqs=6)


@pytest.mark.parametrize(("kind", "tp"), [("llama", 1), ("qwen3", 1),
                                         pytest.param("llama", 2, marks=pytest.mark.slow)])
def test_greedy_is_identical_to_hf(tiny_model, kind, tp):
    """Two stages of one layer each (tp=2: four processes, each stage's KV heads split over
    its two ranks). A small cache and token budget force chunked prefill and preemption;
    the last prompt sent again hits the prefix cache."""
    path, hf = tiny_model(kind)
    cases = mixed_prompts(8, 49152, seed=3, max_len=120, max_new=24)
    llm = LLM(path, pipeline_parallel_size=2, tensor_parallel_size=tp, **SMALL)
    try:
        assert len(llm.engine.executor.procs) == 2 * tp
        got = generate_greedy(llm, cases) + generate_greedy(llm, cases[-1:])
        cases += cases[-1:]
        engine = llm.engine
        assert engine.scheduler.num_preemptions > 0 and engine.kv.prefix_hits > 0
        assert_kv_all_free(engine)
    finally:
        llm.engine.shutdown()
    assert got == [hf_greedy(hf, p, m) for p, m in cases]
    assert no_workers_left()
    assert not [f for f in os.listdir("/dev/shm") if f.startswith("tokenmill-")]


def test_one_step_in_flight_per_stage(tiny_model):
    """With two stages the engine keeps two steps in flight, of different requests (the
    scheduler skips a request whose step is in flight), and applies the oldest."""
    path, _ = tiny_model("llama")
    engine = LLMEngine.from_options(path, pipeline_parallel_size=2, num_kv_blocks=64,
                                    max_num_batched_tokens=16)
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    try:
        for i in range(4):
            engine.add_request(f"r{i}", list(range(10 + i, 22 + i)), params)
        most, overlaps = 0, []
        while engine.has_unfinished_requests():
            engine.step()
            most = max(most, len(engine._in_flight) + 1)  # +1: the one just applied
            ids = [{r.req_id for r in s.scheduled} for s, _, _ in engine._in_flight]
            overlaps += [a & b for i, a in enumerate(ids) for b in ids[i + 1:]]
        assert most == 2
        assert not any(overlaps)
        assert_kv_all_free(engine)
    finally:
        engine.shutdown()


@pytest.mark.slow
def test_smollm2_in_two_and_three_stages(smollm2_path):
    """SmolLM2's 30 layers as 15 + 15 and 10 + 10 + 10 (its tied LM head on the last stage,
    beside the embedding table it shares): the chat answers of one process, token for token."""
    chats = [[{"role": "user", "content": "What is the capital of France?"}],
             [{"role": "user", "content": "Name three colours."}]]
    params = SamplingParams(temperature=0, max_tokens=24)
    answers = []
    for pp in (1, 2, 3):
        llm = LLM(smollm2_path, pipeline_parallel_size=pp, kv_cache_memory="64MiB")
        answers.append([o.outputs[0].token_ids for o in llm.chat(chats, params,
                                                                  use_tqdm=False)])
        llm.engine.shutdown()
    assert answers[0] == answers[1] == answers[2]
    assert no_workers_left()


def test_a_failing_request_fails_alone_with_steps_in_flight(tiny_model):
    """One request fails in the first stage (a token id past the vocabulary, put in after
    validation: the embedding raises, the second stage is told and fails the step too), one
    at the driver (a seed torch cannot take, as in tests/engine/test_failure_isolation.py):
    each ends with "error" while the others finish with the tokens they get alone."""
    path, _ = tiny_model("llama")
    greedy = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    prompts = [[5, 6, 7, 8] * 5, [9, 10, 11] * 7, [12, 13] * 9, [14, 15] * 4]
    ref = LLM(path, num_kv_blocks=64)
    expected = [o.outputs[0].token_ids for o in ref.generate(prompts, greedy, use_tqdm=False)]
    ref.engine.shutdown()
    engine = LLMEngine.from_options(path, pipeline_parallel_size=2, num_kv_blocks=64)
    try:
        for i, p in enumerate(prompts):
            engine.add_request(f"r{i}", p, greedy)
        engine.add_request("bad-token", [3, 4, 5], greedy)
        engine.scheduler.requests["bad-token"].prompt_token_ids[1] = 10**6
        seed = SamplingParams(temperature=1.0, max_tokens=10, ignore_eos=True, seed=1)
        engine.add_request("bad-seed", [3, 4, 5], seed)
        seed.seed = 2**70
        finals = {}
        while engine.has_unfinished_requests():
            finals.update({o.request_id: o for o in engine.step() if o.finished})
        assert finals["bad-token"].outputs[0].finish_reason == "error"
        assert "index" in finals["bad-token"].error.lower()
        assert finals["bad-seed"].outputs[0].finish_reason == "error"
        assert "overflow" in finals["bad-seed"].error.lower()
        assert [finals[f"r{i}"].outputs[0].token_ids for i in range(4)] == expected
        assert_kv_all_free(engine)
        again = engine.add_request("again", prompts[0], greedy)
        del again
        while engine.has_unfinished_requests():
            finals.update({o.request_id: o for o in engine.step() if o.finished})
        assert finals["again"].outputs[0].token_ids == expected[0]  # still serving
    finally:
        engine.shutdown()


def test_a_killed_stage_fails_the_engine_at_once(tiny_model):
    """The first stage killed: the last, waiting for its hidden states, is stopped too."""
    path, _ = tiny_model("llama")
    engine = LLMEngine.from_options(path, pipeline_parallel_size=2, num_kv_blocks=64)
    try:
        for i in range(3):
            engine.add_request(f"r{i}", [5, 6, 7 + i],
                               SamplingParams(max_tokens=200, ignore_eos=True))
        engine.step()
        engine.step()
        os.kill(engine.executor.procs[0].pid, signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(EngineDeadError, match=r"rank 0 \(pid \d+\) exited with code -9"):
            for _ in range(200):
                engine.step()
        assert time.monotonic() - t0 < 10
        assert no_workers_left()
    finally:
        engine.shutdown()


@pytest.mark.parametrize(("options", "message"), [
    ({"pipeline_parallel_size": 3}, "pipeline_parallel_size=3 exceeds the model's 2 layers"),
    ({"pipeline_parallel_size": 2, "speculative_config": {"method": "ngram"}},
     "speculative decoding does not run with pipeline_parallel_size > 1"),
    ({"pipeline_parallel_size": 2, "async_scheduling": True},
     "async_scheduling does not run with"),
])
def test_bad_pipeline_options_are_refused_at_start(tiny_model, options, message):
    path, _ = tiny_model("llama")
    with pytest.raises(ValueError, match=message):
        LLM(path, **options)
    assert no_workers_left()
