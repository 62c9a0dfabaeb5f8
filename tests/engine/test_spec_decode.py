"""Speculative decoding (n-gram) through the engine: greedy output is the same tokens as without
it, with mixed batches, chunked prefill, prefix caching and preemption, on a tiny model and on
SmolLM2; drafts are really proposed, accepted and rejected; max_tokens and logprobs hold per
emitted token; every KV block is freed; a bad speculative config fails at start-up."""

from __future__ import annotations

import random

import pytest

from tests.conftest import assert_kv_all_free, generate_greedy
from tokenmill import LLM, SamplingParams
from tokenmill.metrics.prometheus import PrometheusMetrics
from tokenmill.metrics.stats import StepTimings
from tokenmill.sampling_params import BeamSearchParams
from tokenmill.spec_decode.policy import DRAFT_MODEL_COST, VERIFY_COST_PER_DRAFT, SpecCosts

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4,
         "prompt_lookup_min": 1}
SUFFIX = {"method": "suffix", "num_speculative_tokens": 3}
SELF_INT8 = {"method": "draft_model", "quantization": "int8", "num_speculative_tokens": 3}
SELF_GGUF = {"method": "draft_model", "quantization": "gguf", "num_speculative_tokens": 3}


@pytest.fixture
def smollm2_costs(monkeypatch):
    """A tiny model's draft forward costs about what its step does (Python overhead, not
    weights), so measured costs would rightly stop a draft model from drafting: tests on
    tiny models take SmolLM2's costs instead, to exercise drafting. Tests on SmolLM2 take
    them too: costs measured at start-up on a loaded machine (CI beside other work) came out
    high enough to cut drafts to one token, and the tests count drafts."""
    monkeypatch.setattr("tokenmill.worker.model_runner.measure_spec_costs",
                        lambda *args: SpecCosts(VERIFY_COST_PER_DRAFT, DRAFT_MODEL_COST))


def repetitive_prompts(n: int, seed: int = 0) -> list[tuple[list[int], int]]:
    """Prompts that repeat a random phrase (n-gram drafts then match), and some that do not."""
    rng = random.Random(seed)
    cases = []
    for i in range(n):
        phrase = [rng.randrange(3, 49152) for _ in range(rng.randint(3, 12))]
        tail = [rng.randrange(3, 49152) for _ in range(rng.randint(0, 5))]
        prompt = phrase * rng.randint(1, 6) + tail if i % 4 else tail + [7]
        cases.append((prompt, rng.randint(1, 48)))
    return cases


@pytest.mark.parametrize("options", [
    {},
    {"max_num_batched_tokens": 24},  # chunked prefill beside verify steps
    {"num_kv_blocks": 20, "block_size": 8},  # 152 tokens for 3 requests: preemption
    {"num_kv_blocks": 20, "block_size": 8, "preemption_mode": "swap", "swap_space": "8MiB"},
    {"enable_prefix_caching": False},
], ids=["default", "chunked", "preemption", "swap", "no-prefix-cache"])
@pytest.mark.parametrize("proposer", ["ngram", "suffix", "self-int8", "other-model"])
def test_tiny_model_greedy_output_is_unchanged(smollm2_costs, tiny_model, options, proposer):
    """A random-weight model rarely continues an earlier n-gram, and another random model
    rarely agrees with it: their drafts are rejected, which covers the rollback; its own int8
    copy agrees on most tokens, which covers acceptance (as SmolLM2 does below)."""
    path, _ = tiny_model("llama")
    spec_config = {"ngram": NGRAM, "suffix": SUFFIX, "self-int8": SELF_INT8,
                   "other-model": {"method": "draft_model", "num_speculative_tokens": 3,
                                   "model": tiny_model("llama-mqa-llama3rope")[0]}}[proposer]
    cases = repetitive_prompts(12)
    options = {"max_model_len": 512, "max_num_seqs": 3} | options  # room for drafts
    base = LLM(path, **options)
    expected = generate_greedy(base, cases)
    spec = LLM(path, speculative_config=spec_config, **options)
    assert generate_greedy(spec, cases) == expected
    stats = spec.engine.stats()
    assert stats.spec_decode_num_draft_tokens > 0
    if proposer == "self-int8":
        assert stats.spec_decode_acceptance_rate > 0.8
    elif proposer == "other-model":
        assert stats.spec_decode_acceptance_rate < 0.5
    assert_kv_all_free(spec.engine)
    if options.get("num_kv_blocks"):
        assert spec.engine.scheduler.num_preemptions > 0


CODE = "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\n" * 2
PROMPTS = ["Repeat this code exactly:\n" + CODE, "Tell me a story about a cat.",
           "Copy the list: apples, pears, plums, apples, pears, plums, apples,"]


@pytest.mark.parametrize("options", [
    {},
    {"max_num_batched_tokens": 16},  # prompts in chunks beside verify steps
    {"num_kv_blocks": 15, "block_size": 8},  # 112 tokens for ~230: preemption
    {"num_kv_blocks": 15, "block_size": 8, "preemption_mode": "swap", "swap_space": "64MiB"},
], ids=["default", "chunked", "preemption", "swap"])
def test_smollm2_greedy_unchanged_with_drafts_accepted(smollm2_costs, options):
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    base = LLM(None, **options).generate(PROMPTS, params, use_tqdm=False)
    spec = LLM(None, speculative_config=NGRAM, **options)
    for _ in range(2):  # twice: the second run's prompts hit the prefix cache
        outs = spec.generate(PROMPTS, params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in base]
        assert_kv_all_free(spec.engine)
    stats = spec.engine.stats()
    assert stats.spec_decode_num_accepted_tokens > 10
    assert 0.3 < stats.spec_decode_acceptance_rate < 1.0
    if options.get("num_kv_blocks"):
        assert spec.engine.scheduler.num_preemptions > 0


@pytest.mark.slow
def test_smollm2_suffix_drafts_from_earlier_outputs(smollm2_costs):
    """A second round of the same questions (an agent's retry, a templated answer): suffix
    decoding finds the first round's answers in its cache and most drafts are accepted, where
    n-gram lookup in each request alone finds far less; greedy output is unchanged."""
    chat = ["What are the benefits of regular exercise?", "Explain how a hash table works."]
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    base = [o.outputs[0].token_ids for o in LLM(None).generate(chat, params, use_tqdm=False)]
    accepted = {}
    for name, config in [("suffix", SUFFIX), ("ngram", NGRAM)]:
        llm = LLM(None, speculative_config=config)
        for _ in range(2):
            for prompt, expected in zip(chat, base, strict=True):  # one at a time: drafts
                out = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
                assert out.token_ids == expected
        accepted[name] = llm.engine.stats().spec_decode_num_accepted_tokens
        assert_kv_all_free(llm.engine)
    assert accepted["suffix"] > 60  # of the second round's 94 decode steps
    assert accepted["suffix"] > 2 * accepted["ngram"]


@pytest.mark.parametrize("options", [
    {"max_num_batched_tokens": 16},  # prompts in chunks; prefix cache hits the second time
    {"num_kv_blocks": 15, "block_size": 8, "preemption_mode": "swap", "swap_space": "64MiB"},
], ids=["chunked", "swap"])
@pytest.mark.slow
def test_smollm2_self_draft_greedy_unchanged(smollm2_costs, options):
    """Float32 SmolLM2 drafted for by its own GGUF Q4_1 blocks: the same tokens, most drafts
    accepted (its float32 weights are those blocks expanded). Requests of different lengths,
    so that the batch shrinks to where drafting pays."""
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (48, 9, 20)]
    base = LLM(None, quantization="none", **options).generate(PROMPTS, params, use_tqdm=False)
    spec = LLM(None, quantization="none", speculative_config=SELF_GGUF, **options)
    assert spec.engine.runner.drafter.config.quantization == "gguf"
    for _ in range(2):
        outs = spec.generate(PROMPTS, params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in base]
        assert_kv_all_free(spec.engine)
    stats = spec.engine.stats()
    assert stats.spec_decode_num_accepted_tokens > 30
    assert stats.spec_decode_acceptance_rate > 0.9
    if options.get("num_kv_blocks"):
        assert spec.engine.scheduler.num_preemptions > 0


@pytest.mark.parametrize("proposer", ["ngram", "self-gguf"])
def test_sampled_requests_keep_max_tokens_and_logprobs_per_token(smollm2_costs, proposer):
    llm = (LLM(None, speculative_config=NGRAM) if proposer == "ngram" else
           LLM(None, quantization="none", speculative_config=SELF_GGUF))
    params = [SamplingParams(temperature=0.7, seed=i, max_tokens=m, ignore_eos=True, logprobs=1)
              for i, m in enumerate([37, 8, 21])]
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    for out, p in zip(outs, params, strict=True):
        o = out.outputs[0]
        assert len(o.token_ids) == p.max_tokens
        assert len(o.logprobs) == p.max_tokens
        assert all(t in lp for lp, t in zip(o.logprobs, o.token_ids, strict=True))
    stats = llm.engine.stats()
    assert stats.spec_decode_num_accepted_tokens > 0
    assert_kv_all_free(llm.engine)
    # /metrics: vLLM's spec_decode counters under our prefix, as the engine counted them
    metrics = PrometheusMetrics("m")
    metrics.record(stats, StepTimings())
    text = metrics.render().decode()
    for name, value in [("num_drafts", stats.spec_decode_num_drafts),
                        ("num_draft_tokens", stats.spec_decode_num_draft_tokens),
                        ("num_accepted_tokens", stats.spec_decode_num_accepted_tokens)]:
        assert f'tokenmill:spec_decode_{name}_total{{model_name="m"}} {float(value)}' in text
    per_pos = stats.spec_decode_num_accepted_tokens_per_pos
    assert sum(per_pos) == stats.spec_decode_num_accepted_tokens
    assert list(per_pos) == sorted(per_pos, reverse=True)  # position j needs j - 1 accepted
    for pos, count in enumerate(per_pos):
        assert (f'tokenmill:spec_decode_num_accepted_tokens_per_pos_total{{model_name="m",'
                f'position="{pos}"}} {float(count)}') in text


@pytest.mark.parametrize("spec_config", [NGRAM, SELF_INT8], ids=["ngram", "self-int8"])
def test_beam_search_and_n_samples_run_unchanged(smollm2_costs, tiny_model, spec_config):
    """Beam search steps one token per request (nothing to draft); n > 1 samples draft each
    on their own and keep their seeded streams' distribution (greedy: identical)."""
    path, _ = tiny_model("llama")
    prompt = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6]
    base, spec = LLM(path, max_model_len=256), LLM(path, max_model_len=256,
                                                   speculative_config=spec_config)
    beams = [[s.tokens for s in llm.beam_search([prompt], BeamSearchParams(3, 12))[0].sequences]
             for llm in (base, spec)]
    assert beams[0] == beams[1]
    params = SamplingParams(n=3, temperature=0, max_tokens=16, ignore_eos=True)
    outs = [[o.token_ids for o in llm.generate([prompt], params, use_tqdm=False)[0].outputs]
            for llm in (base, spec)]
    assert outs[0] == outs[1]
    assert_kv_all_free(spec.engine)


@pytest.mark.parametrize("spec_config", [NGRAM, SELF_INT8], ids=["ngram", "self-int8"])
def test_aborts_mid_draft_spare_the_others_and_leak_nothing(smollm2_costs, tiny_model, spec_config):
    path, _ = tiny_model("llama")
    llm = LLM(path, max_model_len=512, max_num_seqs=2, speculative_config=spec_config)
    engine, rng = llm.engine, random.Random(3)
    cases = repetitive_prompts(30, seed=4)
    keep = {f"keep-{i}": c for i, c in enumerate(cases[:3])}
    expected = dict(zip(keep, generate_greedy(LLM(path, max_model_len=512), list(keep.values())),
                        strict=True))
    live, done, aborted_with_drafts = [], {}, 0
    for i, (prompt, max_tokens) in enumerate(cases):
        rid = f"keep-{i}" if i < 3 else f"rand-{i}"
        params = SamplingParams(temperature=0 if i < 3 else rng.choice([0, 0.8]),
                                max_tokens=max_tokens, ignore_eos=True, seed=i)
        engine.add_request(rid, prompt, params)
        live.append(rid)
        for _ in range(rng.randint(0, 3)):
            for out in engine.step():
                if out.finished:
                    live.remove(out.request_id)
                    done[out.request_id] = out.outputs[0].token_ids
        decoding = [r for r in live if r.startswith("rand")
                    and engine.scheduler.requests[r].num_output_tokens]
        if decoding and rng.random() < 0.5:
            rid = rng.choice(decoding)
            aborted_with_drafts += bool(engine.scheduler.requests[rid].proposed_token_ids)
            assert engine.abort_request(rid)
            live.remove(rid)
        engine.kv.check_integrity()
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    assert {r: done[r] for r in keep} == expected
    assert len(done) < len(cases)  # some were aborted
    assert engine.stats().spec_decode_num_draft_tokens > 0
    assert_kv_all_free(engine)
    if engine.runner.drafter is not None:
        assert aborted_with_drafts > 0  # a draft model's drafts were waiting to be verified
        engine.step()  # the last finished ids reach the runner with the next step
        assert engine.runner.drafter._states == {}


def test_draft_model_waits_for_the_first_token(smollm2_costs, tiny_model):
    """The step that computes the prompt returns the first token without running the draft
    model over the prompt; the first decode step asks for drafts, verified the step after."""
    path, _ = tiny_model("llama")
    engine = LLM(path, max_model_len=256, speculative_config=SELF_INT8).engine
    engine.add_request("a", list(range(5, 60)), SamplingParams(temperature=0, max_tokens=20,
                                                              ignore_eos=True))
    engine.step()
    assert engine.scheduler.requests["a"].num_output_tokens == 1
    assert engine.runner.drafter._states == {}
    engine.step()
    assert engine.runner.drafter._states["a"].valid == 55 + 2  # the prompt, two tokens
    proposed = engine.scheduler.requests["a"].proposed_token_ids
    assert proposed and engine.stats().spec_decode_num_draft_tokens == 0
    engine.step()
    assert engine.stats().spec_decode_num_draft_tokens == len(proposed)


def test_cli_flag_reaches_the_config(tiny_model):
    import argparse

    from tokenmill.engine_args import EngineArgs, engine_config

    path, _ = tiny_model("llama")
    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    options = EngineArgs.cli_options(parser.parse_args(
        ["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2}']))
    config = engine_config(path, **options)
    assert (config.speculative.method, config.speculative.num_speculative_tokens) == ("ngram", 2)
    assert config.draft_model is None
    assert engine_config(path).speculative is None
    config = engine_config(path, **EngineArgs.cli_options(parser.parse_args(
        ["--speculative-config", '{"method": "draft_model", "quantization": "int8"}'])))
    assert (config.draft_model.path, config.draft_model.quantization) == (path, "int8")


def test_bad_speculative_config_fails_at_start(tiny_model):
    path, _ = tiny_model("llama")
    with pytest.raises(ValueError, match="supported: ngram"):
        LLM(path, speculative_config={"method": "eagle"})
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        LLM(path, speculative_config={"method": "ngram", "num_speculative_tokens": 0})
