"""What each RequestOutput holds (SamplingParams.output_kind, vLLM's RequestOutputKind): the
same requests run on a real tiny model as CUMULATIVE, DELTA and FINAL_ONLY; the deltas add up
to the cumulative outputs exactly, and FINAL_ONLY hands back only the final one."""

from __future__ import annotations

import dataclasses
from collections import defaultdict

import pytest

from tests.conftest import assert_kv_all_free
from tokenmill import LLM, RequestOutputKind, SamplingParams
from tokenmill.outputs import coalesce

KINDS = RequestOutputKind


@pytest.fixture(scope="module")
def llm(tiny_model):
    path, _ = tiny_model("llama")
    return LLM(path, max_model_len=256, num_kv_blocks=96)


def _requests(stop: str) -> dict[str, tuple[list[int], SamplingParams]]:
    return {
        "greedy": ([5, 6, 7, 8], SamplingParams(temperature=0, max_tokens=14, ignore_eos=True,
                                               logprobs=2, prompt_logprobs=1)),
        # two seeded samples that stop at different steps (one meets a stop token)
        "pair": ([9, 10, 11], SamplingParams(n=2, temperature=1.0, seed=7, max_tokens=11,
                                             ignore_eos=True, logprobs=0,
                                             stop_token_ids=list(range(15000, 20000)))),
        "stop": ([12, 13, 14, 15], SamplingParams(temperature=0, max_tokens=16,
                                                  ignore_eos=True, stop=[stop])),
    }


def _run(llm: LLM, kind: RequestOutputKind, stop: str) -> dict[str, list]:
    """Every output engine.step() hands back, per request id, in order."""
    eng = llm.engine
    for rid, (prompt, params) in _requests(stop).items():
        eng.add_request(f"{kind.name}-{rid}", prompt, dataclasses.replace(params,
                                                                           output_kind=kind))
    got: dict[str, list] = defaultdict(list)
    while eng.has_unfinished_requests():
        for out in eng.step():
            got[out.request_id.split("-", 1)[1]].append(out)
    assert_kv_all_free(eng)
    return got


@pytest.fixture(scope="module")
def stop_string(llm) -> str:
    """Two characters from the middle of the greedy "stop" request's text: a stop string it
    really meets, which it then reaches by several tokens' text."""
    prompt, params = _requests("unused")["stop"]
    text = llm.generate([prompt], dataclasses.replace(params, stop=None),
                        use_tqdm=False)[0].outputs[0].text
    assert len(text) > 12
    return text[len(text) // 2:len(text) // 2 + 2]


@pytest.fixture(scope="module")
def runs(llm, stop_string) -> dict[RequestOutputKind, dict[str, list]]:
    return {kind: _run(llm, kind, stop_string) for kind in KINDS}


def test_deltas_add_up_to_the_cumulative_outputs(runs):
    cumulative, delta = runs[KINDS.CUMULATIVE], runs[KINDS.DELTA]
    for rid, outs in cumulative.items():
        final = outs[-1]
        assert final.finished and [o.finished for o in outs].count(True) == 1
        deltas = delta[rid]
        assert deltas[-1].finished and not any(o.finished for o in deltas[:-1])
        for c in final.outputs:
            parts = [d for o in deltas for d in o.outputs if d.index == c.index]
            assert "".join(d.text for d in parts) == c.text
            assert [t for d in parts for t in d.token_ids] == c.token_ids
            if c.logprobs is not None:
                assert [lp for d in parts for lp in d.logprobs] == c.logprobs
                assert parts[-1].cumulative_logprob == c.cumulative_logprob
            # the finish reason once, on the last part; none of the parts empty before it
            assert [d.finish_reason for d in parts] == [None] * (len(parts) - 1) + [
                c.finish_reason]
            assert all(d.token_ids or d.text for d in parts[:-1])
        # prompt logprobs with the first output only
        assert deltas[0].prompt_logprobs == final.prompt_logprobs
        assert all(o.prompt_logprobs is None for o in deltas[1:])


def test_a_delta_holds_only_the_samples_that_changed(runs):
    pair = runs[KINDS.DELTA]["pair"]
    lengths = [len(c.token_ids) for c in runs[KINDS.CUMULATIVE]["pair"][-1].outputs]
    assert lengths[0] != lengths[1]  # (seeded: the samples really finish apart)
    assert any(len(o.outputs) == 1 for o in pair)
    assert sum(len(o.outputs) for o in pair) < 2 * len(pair)


def test_coalesced_outputs_equal_the_cumulative_output_of_their_last_step(runs):
    """A reader that finds outputs k..j waiting takes them as one (engine/request_stream.py):
    joined deltas, or the latest cumulative output, equal the cumulative output of step j."""
    for rid, cumulative in runs[KINDS.CUMULATIVE].items():
        deltas = runs[KINDS.DELTA][rid]
        assert len(deltas) == len(cumulative) > 3
        for start in (0, 1, 2):
            joined, latest = deltas[start], cumulative[start]
            for j in range(start + 1, len(deltas)):
                joined = coalesce(joined, deltas[j], delta=True)
                latest = coalesce(latest, cumulative[j], delta=False)
                assert latest is cumulative[j]
                assert joined.finished == cumulative[j].finished
                # from the first output on, the join is everything so far
                if start == 0:
                    assert joined.outputs == cumulative[j].outputs
                    assert joined.prompt_logprobs == cumulative[j].prompt_logprobs
            if start > 0:  # a later run of deltas: the tail of the final output
                for c in cumulative[-1].outputs:
                    part = next(d for d in joined.outputs if d.index == c.index)
                    assert c.token_ids[-len(part.token_ids):] == part.token_ids
                    assert c.text.endswith(part.text)
                    assert part.finish_reason == c.finish_reason
                assert joined.prompt_logprobs is None


def test_a_stop_string_is_cut_the_same_in_every_kind(runs, stop_string):
    finals = {kind: runs[kind]["stop"][-1].outputs[0] for kind in KINDS}
    cut = finals[KINDS.CUMULATIVE]
    assert cut.finish_reason == "stop" and cut.stop_reason == stop_string
    assert stop_string not in cut.text
    assert finals[KINDS.FINAL_ONLY] == cut
    # (deltas only append: none of them showed text the stop string then cut off)
    assert "".join(c.text for o in runs[KINDS.DELTA]["stop"] for c in o.outputs) == cut.text


def test_final_only_hands_back_one_output_equal_to_the_cumulative_final(runs):
    for rid, outs in runs[KINDS.FINAL_ONLY].items():
        assert len(outs) == 1 and outs[0].finished
        want = runs[KINDS.CUMULATIVE][rid][-1]
        assert outs[0].outputs == want.outputs
        assert outs[0].prompt_logprobs == want.prompt_logprobs


def test_an_aborted_delta_request_reports_its_end(llm):
    eng = llm.engine
    eng.add_request("abort-me", [20, 21, 22], SamplingParams(
        temperature=0, max_tokens=30, ignore_eos=True, output_kind=KINDS.DELTA))
    seen = []
    for _ in range(4):
        seen += [c for o in eng.step() for c in o.outputs]
    out = eng.finish_request("abort-me", "abort")
    assert out.finished and out.outputs[0].finish_reason == "abort"
    assert out.outputs[0].token_ids == []  # everything generated was handed out already
    assert len([t for c in seen for t in c.token_ids]) == 4
    assert_kv_all_free(eng)


def test_llm_generate_asks_for_final_outputs_and_leaves_the_params_alone(llm):
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True,
                            output_kind=KINDS.DELTA)
    outs = llm.generate([[5, 6, 7, 8], [9, 10]], params, use_tqdm=False)
    assert params.output_kind is KINDS.DELTA
    want = llm.generate([[5, 6, 7, 8], [9, 10]], dataclasses.replace(
        params, output_kind=KINDS.CUMULATIVE), use_tqdm=False)
    assert [o.outputs for o in outs] == [o.outputs for o in want]
    assert all(len(o.outputs[0].token_ids) == 6 for o in outs)


@pytest.mark.parametrize("value, want", [(1, KINDS.DELTA), (KINDS.FINAL_ONLY, KINDS.FINAL_ONLY)])
def test_output_kind_accepts_its_values(value, want):
    assert SamplingParams(output_kind=value).output_kind is want


@pytest.mark.parametrize("value", [3, "delta", True, 1.0, None])
def test_output_kind_refuses_anything_else(value):
    with pytest.raises(ValueError, match="output_kind must be a RequestOutputKind"):
        SamplingParams(output_kind=value)


def test_latencies_are_observed_alike_whatever_the_kind(llm, stop_string):
    """The server's TTFT / inter-token / end-to-end observations come from each step's
    progress: a FINAL_ONLY request, which hands back one output, is timed as a streamed one."""
    from tokenmill.metrics.stats import RequestTimings

    eng = llm.engine
    counts = {}
    for kind in KINDS:
        eng.outputs.timings = timings = RequestTimings()
        try:
            got = _run(llm, kind, stop_string)
        finally:
            eng.outputs.timings = None
        step = timings.take()
        generated = sum(len(c.token_ids) for outs in got.values() for o in outs
                        for c in o.outputs)
        counts[kind] = (len(step.ttft), len(step.inter_token), len(step.e2e), step.finished,
                        step.generation_tokens, step.prompt_tokens)
        if kind is not KINDS.CUMULATIVE:
            assert step.generation_tokens == generated
    ttft, inter_token, e2e, finished = counts[KINDS.CUMULATIVE][:4]
    assert ttft == e2e == finished == 3 and inter_token > 10
    assert counts[KINDS.DELTA] == counts[KINDS.CUMULATIVE] == counts[KINDS.FINAL_ONLY]
