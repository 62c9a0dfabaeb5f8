"""Prefix caching and swap preemption on real tiny models: greedy outputs identical with the
cache on and off (and to Hugging Face) for shared, branching and fully cached prompts and under
eviction; the cache really skips prefill work; swap preemption keeps outputs and returns every
block, falling back to recompute when the swap space is full."""

from __future__ import annotations

import random

import pytest

from tests.conftest import assert_kv_all_free, generate_greedy, hf_greedy
from tokenmill import LLM, SamplingParams


def workload(seed: int = 0) -> list[tuple[list[int], int]]:
    """Shared system prompt, branching user turns, exact repeats."""
    rng = random.Random(seed)
    words = lambda n: [rng.randrange(3, 49152) for _ in range(n)]
    system = words(70)
    branch_a, branch_b = words(33), words(20)
    cases = [(system + words(9), 12), (system + branch_a + words(5), 10),
             (system + branch_a + words(17), 8), (system + branch_b, 12),
             (system + branch_b + words(40), 6), (words(30), 10)]
    return cases + [cases[1], cases[0]]  # fully cached prompts


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def model_and_reference(request, tiny_model):
    path, hf = tiny_model(request.param)
    cases = workload()
    return path, cases, [hf_greedy(hf, p, m) for p, m in cases]


def run_in_two_waves(llm: LLM, cases):
    """Half first, so the second half finds their prefixes cached."""
    half = len(cases) // 2
    return generate_greedy(llm, cases[:half]) + generate_greedy(llm, cases[half:])


def test_cache_on_equals_off_equals_hf(model_and_reference):
    path, cases, expected = model_and_reference
    on, off = LLM(path), LLM(path, enable_prefix_caching=False)
    assert run_in_two_waves(on, cases) == expected
    assert run_in_two_waves(off, cases) == expected
    s_on, s_off = on.engine.stats(), off.engine.stats()
    assert s_off.prefix_cache_hits == 0 and s_on.prefix_cache_hit_rate > 0.4
    assert s_on.num_prompt_tokens_computed < 0.6 * s_off.num_prompt_tokens_computed
    assert s_on.prefix_cache_queries == s_off.prefix_cache_queries == sum(
        len(p) for p, _ in cases)
    assert_kv_all_free(on.engine)
    assert on.engine.kv.tree.num_cached_blocks > 0  # cached, yet counted free


def test_whole_batch_at_once_and_chunked(model_and_reference):
    path, cases, expected = model_and_reference
    llm = LLM(path, max_num_batched_tokens=24)
    assert generate_greedy(llm, cases) == expected
    assert llm.engine.stats().prefix_cache_hits > 0
    assert_kv_all_free(llm.engine)


def test_eviction_under_a_small_pool(model_and_reference):
    path, cases, expected = model_and_reference
    llm = LLM(path, num_kv_blocks=20, block_size=8)  # largest request: 16; workload: ~75
    for _ in range(2):
        assert run_in_two_waves(llm, cases) == expected
    assert llm.engine.scheduler.num_preemptions > 0
    assert_kv_all_free(llm.engine)


def test_n_samples_with_cache_and_abort(tiny_model):
    path, _ = tiny_model("llama")
    llm = LLM(path)
    prompt = list(range(400, 470))
    params = SamplingParams(n=3, temperature=0.8, seed=4, max_tokens=10, ignore_eos=True)
    first = [c.token_ids for c in llm.generate([prompt], params, use_tqdm=False)[0].outputs]
    again = [c.token_ids for c in llm.generate([prompt], params, use_tqdm=False)[0].outputs]
    assert first == again and llm.engine.stats().prefix_cache_hits >= 64
    engine = llm.engine
    engine.add_request("x", prompt, params)
    for _ in range(3):
        engine.step()
    engine.abort_request("x")
    assert_kv_all_free(engine)


@pytest.mark.parametrize("swap_space", ["64MiB", "40KiB"])  # room for all / for almost none
def test_swap_preemption_keeps_outputs(model_and_reference, swap_space):
    path, cases, expected = model_and_reference
    llm = LLM(path, num_kv_blocks=20, block_size=8, preemption_mode="swap",
              swap_space=swap_space, enable_prefix_caching=False)
    assert generate_greedy(llm, cases) == expected
    assert llm.engine.scheduler.num_preemptions > 0
    kv = llm.engine.kv
    assert kv.swap.num_free_blocks == kv.swap.num_blocks and not kv.swap.req_to_blocks
    assert_kv_all_free(llm.engine)


def test_swap_really_swaps(tiny_model):
    path, hf = tiny_model("llama")
    cases = [(list(range(100 + i, 160 + i)), 40) for i in range(6)]
    llm = LLM(path, num_kv_blocks=30, block_size=8, preemption_mode="swap")
    engine, swapped = llm.engine, 0
    for i, (p, m) in enumerate(cases):
        engine.add_request(str(i), p, SamplingParams(temperature=0, max_tokens=m,
                                                     ignore_eos=True))
    outs = {}
    while engine.has_unfinished_requests():
        sched = engine.scheduler.schedule()
        swapped += len(sched.blocks_to_swap_out)
        runner_out = engine.runner.execute(sched)
        for r in engine.scheduler.update_from_output(sched, runner_out):
            if r.is_finished:
                outs[r.request_id] = r.output_token_ids
        engine.outputs.process([], runner_out)
    assert swapped > 0
    assert [outs[str(i)] for i in range(6)] == [hf_greedy(hf, p, m) for p, m in cases]


def test_bad_preemption_mode():
    from tokenmill.config import SchedulerConfig

    with pytest.raises(ValueError, match="preemption_mode"):
        SchedulerConfig(preemption_mode="drop")


def test_prompt_logprobs_bypass_the_cache(tiny_model):
    path, _ = tiny_model("llama")
    llm = LLM(path)
    prompt = list(range(600, 660))
    params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=1)
    first, again = (llm.generate([prompt], params, use_tqdm=False)[0] for _ in range(2))
    assert all(e is not None for e in again.prompt_logprobs[1:])
    assert [e[t].logprob for e, t in zip(again.prompt_logprobs[1:], prompt[1:], strict=True)] \
        == [e[t].logprob for e, t in zip(first.prompt_logprobs[1:], prompt[1:], strict=True)]
    assert llm.engine.stats().prefix_cache_hits == 0


def test_reset_prefix_cache_forgets_prompts(tiny_model):
    path, _ = tiny_model("llama")
    llm = LLM(path, block_size=16)
    cases = [(list(range(100, 180)), 4)]
    first = generate_greedy(llm, cases)
    assert generate_greedy(llm, cases) == first
    assert llm.engine.kv.prefix_hits == 64  # 79 tokens looked up: 4 whole blocks
    assert llm.reset_prefix_cache()
    assert generate_greedy(llm, cases) == first
    assert llm.engine.kv.prefix_hits == 64  # computed from scratch this time
    assert_kv_all_free(llm.engine)


def test_outputs_count_their_cached_prompt_tokens(tiny_model):
    """RequestOutput.num_cached_tokens (vLLM's): the prompt tokens a request found computed
    when first admitted: none the first time, its full blocks the second, every sample's."""
    llm = LLM(tiny_model("llama")[0], max_model_len=256, num_kv_blocks=64)
    prompt = [3000 + i for i in range(40)]  # two full blocks of 16, then 8 tokens
    params = SamplingParams(temperature=0, max_tokens=3, n=2)
    (first,) = llm.generate([prompt], params, use_tqdm=False)
    (again,) = llm.generate([prompt], params, use_tqdm=False)
    assert (first.num_cached_tokens, again.num_cached_tokens) == (0, 32)
    assert [c.token_ids for c in first.outputs] == [c.token_ids for c in again.outputs]
