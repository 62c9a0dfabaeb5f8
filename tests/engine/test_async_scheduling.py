"""Async scheduling (vLLM's --async-scheduling): step N+1 is scheduled while the model runs
step N, and prepared by the runner before N's tokens reach the host, fed the ids N sampled on
the device (worker/in_flight.py). Outputs must be exactly those of
synchronous steps (greedy: Hugging Face's) under chunked prefill, prefix-cache hits, preemption
by recompute and by swap, parallel samples, penalties, logprobs, min_tokens, stop strings and
EOS, aborts; every KV block comes back; under TP=2 too. Speculative decoding and PP > 1 are
refused."""

from __future__ import annotations

import pytest

from tests.conftest import assert_kv_all_free, generate_greedy, hf_greedy, mixed_prompts
from tokenmill import LLM, SamplingParams


@pytest.fixture(params=["step thread", "inline"])
def launches(request, monkeypatch):
    """Where the runner's launches run: the executor's step thread (CPU), or the engine's own
    thread, each returning once its step is queued (a GPU's way, executor/uniproc.py)."""
    if request.param == "inline":
        from tokenmill.executor.uniproc import UniProcExecutor

        monkeypatch.setattr(UniProcExecutor, "STEP_THREAD_DEVICES", frozenset())
    return request.param


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_greedy_is_identical_to_hf_under_pressure(tiny_model, mode, launches):
    path, hf = tiny_model("llama")
    cases = mixed_prompts(10, 49152, seed=3, max_len=120, max_new=24)
    llm = LLM(path, async_scheduling=True, num_kv_blocks=40, block_size=8,
              max_num_batched_tokens=64, max_num_seqs=6, preemption_mode=mode,
              swap_space="64MiB")
    got = generate_greedy(llm, cases) + generate_greedy(llm, cases[-1:])
    cases += cases[-1:]
    assert got == [hf_greedy(hf, p, m) for p, m in cases]
    engine = llm.engine
    assert engine.scheduler.num_preemptions > 0 and engine.kv.prefix_hits > 0
    assert_kv_all_free(engine)
    # steps were prepared while the one before ran: their tokens fed on the device
    assert engine.runner.num_fed_in_flight > 50
    assert engine.executor.on_step_thread == (launches == "step thread")


def test_sampled_outputs_are_those_of_synchronous_steps(tiny_model, launches):
    """Seeded sampling with penalties (which read the runner's own copy of the outputs, its
    in-flight token included), n = 3, logprobs and min_tokens; some requests end by EOS or a
    stop string (a step already scheduled for them is dropped)."""
    path, _ = tiny_model("llama")
    params = [SamplingParams(temperature=0.9, seed=5, max_tokens=30, n=3, presence_penalty=0.5,
                             frequency_penalty=0.3, repetition_penalty=1.2, logprobs=2,
                             min_tokens=4),
              SamplingParams(temperature=1.3, seed=7, max_tokens=40, top_k=50, stop=["e"]),
              SamplingParams(temperature=0, max_tokens=25, logprobs=1)]
    prompts = [[5, 6, 7, 8] * 5, list(range(300, 340)), [9] * 30]
    results, logprobs = [], []
    for async_scheduling in (False, True):
        llm = LLM(path, async_scheduling=async_scheduling, num_kv_blocks=64)
        outs = llm.generate(prompts, params, use_tqdm=False)
        results.append([[(c.token_ids, c.text, c.finish_reason) for c in o.outputs]
                        for o in outs])
        logprobs.append([d for o in outs for c in o.outputs for d in c.logprobs or []])
        assert_kv_all_free(llm.engine)
    assert results[0] == results[1]
    # steps are batched differently (a step ahead), so the logits' last bits may differ
    assert len(logprobs[0]) == len(logprobs[1]) > 100
    for a, b in zip(*logprobs, strict=True):
        assert a.keys() == b.keys()
        assert all(abs(a[t].logprob - b[t].logprob) < 1e-4 for t in a)
        # the top-k keep their ranks (a sampled token far down may swap with a near tie)
        assert {t: lp.rank for t, lp in a.items() if lp.rank <= 2} == \
            {t: lp.rank for t, lp in b.items() if lp.rank <= 2}
    reasons = {c[2] for o in results[0] for c in o}
    assert "stop" in reasons and "length" in reasons


def test_chat_answers_with_eos_are_unchanged(smollm2_path):
    chats = [[{"role": "user", "content": "What is the capital of France?"}],
             [{"role": "user", "content": "Name three colours."}]]
    params = SamplingParams(temperature=0, max_tokens=48)
    answers = []
    for async_scheduling in (False, True):
        llm = LLM(smollm2_path, async_scheduling=async_scheduling, kv_cache_memory="64MiB")
        outs = llm.chat(chats, params, use_tqdm=False)
        answers.append([(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in outs])
        assert_kv_all_free(llm.engine)
    assert answers[0] == answers[1]
    assert answers[1][0][1] == "stop"  # ended by EOS with a step in flight


def test_abort_with_a_step_in_flight_frees_everything(tiny_model, launches):
    path, _ = tiny_model("llama")
    llm = LLM(path, async_scheduling=True, num_kv_blocks=64)
    engine = llm.engine
    for i in range(3):
        engine.add_request(str(i), [5, 6, 7, 8, 9], SamplingParams(max_tokens=50,
                                                                  ignore_eos=True))
    for _ in range(4):
        engine.step()
    assert engine._in_flight  # a step in flight
    for i in range(3):
        assert engine.abort_request(str(i))
    while engine.has_unfinished_requests():  # drains the step in flight
        assert engine.step() == []
    assert_kv_all_free(engine)
    engine.add_request("after", [5, 6, 7], SamplingParams(max_tokens=5, temperature=0))
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 5


@pytest.mark.slow
def test_tensor_parallel_ranks_feed_the_driver_s_tokens(tiny_model):
    """TP=2: the next step is sent before this one's tokens are back, so the driver hands its
    sampled tokens to the other rank each step (the shared-memory all-reduce as a broadcast):
    greedy output is Hugging Face's under preemption and prefix hits, seeded sampling is the
    synchronous run's, and a request whose sampling fails on the driver fails alone (the
    other rank, told, fails the step with it) while the rest go on."""
    path, hf = tiny_model("llama")
    cases = mixed_prompts(8, 49152, seed=3, max_len=120, max_new=24)
    llm = LLM(path, async_scheduling=True, tensor_parallel_size=2, num_kv_blocks=40,
              block_size=8, max_num_batched_tokens=64, max_num_seqs=6)
    try:
        got = generate_greedy(llm, cases) + generate_greedy(llm, cases[-1:])
        engine = llm.engine
        assert engine.scheduler.num_preemptions > 0 and engine.kv.prefix_hits > 0
        assert_kv_all_free(engine)
    finally:
        llm.engine.shutdown()
    assert got == [hf_greedy(hf, p, m) for p, m in cases + cases[-1:]]

    prompts = [[5, 6, 7, 8] * 5, list(range(300, 340)), [9] * 30]
    params = [SamplingParams(temperature=0.9, seed=5, max_tokens=30, n=2,
                             presence_penalty=0.5, min_tokens=4),
              SamplingParams(temperature=1.3, seed=7, max_tokens=40, top_k=50),
              SamplingParams(temperature=0, max_tokens=25)]
    results = []
    for async_scheduling in (False, True):
        llm = LLM(path, async_scheduling=async_scheduling, tensor_parallel_size=2,
                  num_kv_blocks=64)
        try:
            engine = llm.engine
            for i, (p, sp) in enumerate(zip(prompts, params, strict=True)):
                engine.add_request(f"r{i}", p, sp)
            bad = SamplingParams(temperature=1.0, max_tokens=10, seed=1)
            engine.add_request("bad", [3, 4, 5], bad)
            bad.seed = 2**70  # valid when checked; torch's manual_seed then overflows
            finals = {}
            while engine.has_unfinished_requests():
                finals.update({o.request_id: o for o in engine.step() if o.finished})
            assert finals.pop("bad").outputs[0].finish_reason == "error"
            results.append({rid: [c.token_ids for c in o.outputs] for rid, o in finals.items()})
            assert_kv_all_free(engine)
        finally:
            llm.engine.shutdown()
    assert results[0] == results[1] and len(results[0]) == 3


@pytest.mark.parametrize("options", [
    {"speculative_config": {"method": "ngram", "num_speculative_tokens": 2}},
    {"pipeline_parallel_size": 2},
])
def test_refused_with_what_it_does_not_run_with(tiny_model, options):
    path, _ = tiny_model("llama")
    with pytest.raises(ValueError, match="async_scheduling does not run with"):
        LLM(path, async_scheduling=True, **options)


def test_on_by_default_where_it_runs_on_cuda():
    """vLLM's default: on where it runs (CUDA, one rank, no drafts, no pipeline); off on CPU
    unless asked; asked off, off."""
    from tokenmill.config_scheduler import resolve_async_scheduling
    from tokenmill.distributed.config import ParallelConfig
    from tokenmill.spec_decode.config import SpeculativeConfig

    one, tp2 = ParallelConfig(), ParallelConfig(tensor_parallel_size=2)
    ngram = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 2})
    assert resolve_async_scheduling(None, "cuda", None, one) is True
    assert resolve_async_scheduling(None, "cuda:1", None, one) is True
    assert resolve_async_scheduling(None, "cpu", None, one) is False
    assert resolve_async_scheduling(None, "cuda", None, tp2) is False
    assert resolve_async_scheduling(None, "cuda", ngram, one) is False
    assert resolve_async_scheduling(False, "cuda", None, one) is False
    assert resolve_async_scheduling(True, "cpu", None, tp2) is True
    with pytest.raises(ValueError, match="True or False"):
        resolve_async_scheduling("yes", "cuda", None, one)
