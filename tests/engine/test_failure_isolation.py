"""One request that fails inside a step fails alone: injected into a running batch (a seed
that passed validation and was then changed to one torch cannot take, exactly the overflow
of issue 15), it ends with finish_reason "error" while every other request finishes with the
tokens it gets alone, every block is freed and the prefix cache is not trusted until idle.
A failure no single request explains kills the engine with EngineDeadError."""

from __future__ import annotations

import pytest

from tests.conftest import assert_kv_all_free
from tokenmill import LLM, SamplingParams
from tokenmill.engine.llm_engine import EngineDeadError

GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
PROMPTS = [[5, 6, 7, 8] * 5, [9, 10, 11] * 7, [12, 13] * 9]


@pytest.fixture(scope="module")
def llm(tiny_model):
    path, _ = tiny_model("llama")
    return LLM(path, max_model_len=256, num_kv_blocks=64)


def poisoned(**kw) -> SamplingParams:
    """Valid when checked, then given a seed past 64 bits (torch's manual_seed overflows)."""
    params = SamplingParams(temperature=1.0, max_tokens=10, ignore_eos=True, seed=1, **kw)
    params.seed = 2**70
    return params


def run(engine, requests: dict[str, tuple[list[int], SamplingParams]], inject_at: int = 2):
    """Step the engine to the end; the poisoned request joins after `inject_at` steps."""
    finals = {}
    good = {rid: r for rid, r in requests.items() if rid != "bad"}
    for rid, (prompt, params) in good.items():
        engine.add_request(rid, prompt, params)
    steps = 0
    while engine.has_unfinished_requests() or "bad" not in finals:
        if steps == inject_at and "bad" in requests:
            engine.add_request("bad", *requests["bad"])
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
        steps += 1
    return finals


@pytest.fixture(scope="module")
def llm_ahead(tiny_model):
    """Async scheduling: each step's inputs are prepared while the one before runs, its
    tokens fed on the device (worker/in_flight.py)."""
    path, _ = tiny_model("llama")
    return LLM(path, max_model_len=256, num_kv_blocks=64, async_scheduling=True)


@pytest.fixture(scope="module")
def llm_inline(tiny_model):
    """The same, each step launched from the engine's own thread (a GPU's way)."""
    from tokenmill.executor.uniproc import UniProcExecutor

    path, _ = tiny_model("llama")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(UniProcExecutor, "STEP_THREAD_DEVICES", frozenset())
        return LLM(path, max_model_len=256, num_kv_blocks=64, async_scheduling=True)


@pytest.mark.parametrize("engine_kind", ["sync", "ahead", "inline"])
def test_failing_request_fails_alone_in_a_running_batch(llm, llm_ahead, llm_inline,
                                                        engine_kind):
    """With steps run ahead, the bad request's step fails before its tokens are in flight
    and the next step is sent only after its requests were executed again alone."""
    llm = {"sync": llm, "ahead": llm_ahead, "inline": llm_inline}[engine_kind]
    engine = llm.engine
    fed = engine.runner.num_fed_in_flight
    ref = {f"r{i}": o.outputs[0].token_ids
           for i, o in enumerate(llm.generate(PROMPTS, GREEDY, use_tqdm=False))}
    requests = {f"r{i}": (p, GREEDY) for i, p in enumerate(PROMPTS)}
    requests["bad"] = ([3, 4, 5], poisoned())
    finals = run(engine, requests)
    bad = finals["bad"]
    assert [c.finish_reason for c in bad.outputs] == ["error"]
    assert "Overflow" in bad.error or "overflow" in bad.error
    for rid, tokens in ref.items():
        assert finals[rid].error is None
        assert finals[rid].outputs[0].token_ids == tokens  # unaffected, token for token
        assert finals[rid].outputs[0].finish_reason == "length"
    assert_kv_all_free(engine)
    assert not engine.kv.prefix_cache_suspended  # reset once idle
    # the engine keeps serving
    again = llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)[0]
    assert again.outputs[0].token_ids == ref["r0"]
    assert (engine.runner.num_fed_in_flight > fed) == (engine_kind != "sync")


def test_prefix_cache_suspended_after_a_failure(llm):
    engine = llm.engine
    engine.add_request("long", [7] * 40, SamplingParams(temperature=0, max_tokens=30,
                                                        ignore_eos=True))
    engine.add_request("bad", [3, 4, 5], poisoned())
    outs = {o.request_id: o for o in engine.step()}
    assert outs["bad"].outputs[0].finish_reason == "error"
    assert engine.kv.prefix_cache_suspended
    # a request now gets no cache hit, even on a prefix that is cached
    engine.add_request("same", [7] * 40, SamplingParams(temperature=0, max_tokens=2))
    hits = engine.kv.prefix_hits
    engine.step()
    assert engine.kv.prefix_hits == hits
    while engine.has_unfinished_requests():
        engine.step()
    assert not engine.kv.prefix_cache_suspended
    assert_kv_all_free(engine)


def test_failure_of_every_request_kills_the_engine(tiny_model):
    path, _ = tiny_model("llama")
    llm = LLM(path, max_model_len=256, num_kv_blocks=64)
    llm.engine.add_request("a", [3, 4], poisoned())
    llm.engine.add_request("b", [5, 6], poisoned())
    with pytest.raises(EngineDeadError, match="every request"):
        llm.engine.step()


def test_failing_alone_again_and_again_kills_the_engine(tiny_model):
    """One request alone cannot be told from a broken engine, so three such steps in a row
    are taken as the engine's fault."""
    path, _ = tiny_model("llama")
    llm = LLM(path, max_model_len=256, num_kv_blocks=64)
    for i in range(2):
        llm.engine.add_request(f"bad{i}", [3, 4], poisoned())
        (out,) = llm.engine.step()
        assert out.outputs[0].finish_reason == "error"
    llm.engine.add_request("bad2", [3, 4], poisoned())
    with pytest.raises(EngineDeadError):
        llm.engine.step()
