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

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4,
         "prompt_lookup_min": 1}


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
    {"enable_prefix_caching": False},
], ids=["default", "chunked", "preemption", "no-prefix-cache"])
def test_tiny_model_greedy_output_is_unchanged(tiny_model, options):
    """A random-weight model rarely continues an earlier n-gram: its drafts are rejected, so
    this covers the rollback (SmolLM2 below covers acceptance)."""
    path, _ = tiny_model("llama")
    cases = repetitive_prompts(12)
    options = {"max_model_len": 512, "max_num_seqs": 3} | options  # room for drafts
    base = LLM(path, **options)
    expected = generate_greedy(base, cases)
    spec = LLM(path, speculative_config=NGRAM, **options)
    assert generate_greedy(spec, cases) == expected
    assert spec.engine.stats().spec_decode_num_draft_tokens > 0
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
def test_smollm2_greedy_unchanged_with_drafts_accepted(options):
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


def test_sampled_requests_keep_max_tokens_and_logprobs_per_token():
    llm = LLM(None, speculative_config=NGRAM)
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


def test_beam_search_and_n_samples_run_unchanged(tiny_model):
    """Beam search steps one token per request (nothing to draft); n > 1 samples draft each
    on their own and keep their seeded streams' distribution (greedy: identical)."""
    path, _ = tiny_model("llama")
    prompt = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6]
    base, spec = LLM(path, max_model_len=256), LLM(path, max_model_len=256,
                                                   speculative_config=NGRAM)
    beams = [[s.tokens for s in llm.beam_search([prompt], BeamSearchParams(3, 12))[0].sequences]
             for llm in (base, spec)]
    assert beams[0] == beams[1]
    params = SamplingParams(n=3, temperature=0, max_tokens=16, ignore_eos=True)
    outs = [[o.token_ids for o in llm.generate([prompt], params, use_tqdm=False)[0].outputs]
            for llm in (base, spec)]
    assert outs[0] == outs[1]
    assert_kv_all_free(spec.engine)


def test_cli_flag_reaches_the_config(tiny_model):
    import argparse

    from tokenmill.cli import add_engine_args, engine_options
    from tokenmill.config import EngineConfig

    path, _ = tiny_model("llama")
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    options = engine_options(parser.parse_args(
        ["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2}']))
    config = EngineConfig.create(path, **options)
    assert (config.speculative.method, config.speculative.num_speculative_tokens) == ("ngram", 2)
    assert EngineConfig.create(path).speculative is None


def test_bad_speculative_config_fails_at_start(tiny_model):
    path, _ = tiny_model("llama")
    with pytest.raises(ValueError, match="supported: ngram"):
        LLM(path, speculative_config={"method": "eagle"})
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        LLM(path, speculative_config={"method": "ngram", "num_speculative_tokens": 0})
