"""Greedy output of the engine is token-identical to Hugging Face transformers (float32, same
weights) on tiny random Llama / Qwen2 / Qwen3 models, for a mixed-length batch, with the
default scheduler, with chunked prefill forced (budget 32) and under preemption.

Every engine here asks for float32: on CUDA `dtype="auto"` serves a float32 checkpoint in
bfloat16 (as vLLM does), which no float32 reference matches token for token. On a CUDA machine
the engine runs on the GPU (its default device) against HF's float32 forward on the CPU."""

from __future__ import annotations

import pytest

from tests.conftest import (
    TINY_MODELS,
    assert_kv_all_free,
    generate_greedy,
    hf_greedy,
    mixed_prompts,
)
from tokenmill import LLM
from tokenmill.attention.triton_paged import triton_available


@pytest.fixture(scope="module")
def references(tiny_model):
    cache = {}

    def get(kind: str) -> tuple[str, list[tuple[list[int], int]], list[list[int]]]:
        if kind not in cache:
            path, hf = tiny_model(kind)
            cases = mixed_prompts(10, hf.config.vocab_size, seed=1)
            cache[kind] = (path, cases, [hf_greedy(hf, p, m) for p, m in cases])
        return cache[kind]

    return get


@pytest.mark.parametrize("kind", list(TINY_MODELS))
def test_greedy_matches_hf(references, kind):
    path, cases, expected = references(kind)
    llm = LLM(path, dtype="float32")
    assert generate_greedy(llm, cases) == expected
    assert_kv_all_free(llm.engine)


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3"])
def test_chunked_prefill_matches_hf(references, kind):
    path, cases, expected = references(kind)
    llm = LLM(path, dtype="float32", max_num_batched_tokens=32)
    assert generate_greedy(llm, cases) == expected
    assert_kv_all_free(llm.engine)


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_preemption_keeps_outputs(references, kind):
    path, cases, expected = references(kind)
    # The longest request needs 364 tokens = 23 blocks: the pool holds it, never the batch.
    llm = LLM(path, dtype="float32", num_kv_blocks=24, block_size=16)
    assert generate_greedy(llm, cases) == expected
    assert llm.engine.scheduler.num_preemptions > 0
    assert_kv_all_free(llm.engine)


def test_chunked_prefill_and_preemption_together(references):
    path, cases, expected = references("llama")
    llm = LLM(path, dtype="float32", num_kv_blocks=48, max_num_batched_tokens=48,
              block_size=8)
    assert generate_greedy(llm, cases) == expected
    assert llm.engine.scheduler.num_preemptions > 0
    assert_kv_all_free(llm.engine)


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_reference_paths_match_hf(references, kind):
    """The PyTorch attention backend (the kernels' oracle) and plain F.linear weights, end to end
    with chunked prefill."""
    path, cases, expected = references(kind)
    llm = LLM(path, dtype="float32", attention_backend="torch", prepack_weights=False,
              max_num_batched_tokens=64)
    assert generate_greedy(llm, cases) == expected
    assert_kv_all_free(llm.engine)


@pytest.mark.skipif(not triton_available(), reason="triton not installed")
def test_triton_attention_matches_hf(references):
    """The Triton kernel backend end to end with chunked prefill, then the same prompts again
    as prefix-cache hits (prefill over a cached prefix). On a machine without CUDA the kernel
    runs in Triton's interpreter (tests/conftest.py), so the batch is kept small."""
    path, cases, expected = references("llama")
    # Prompts of 1, 300, 17, 2 and 130 tokens; a greedy run's first tokens are the reference's.
    cases = [(prompt, min(m, 12)) for prompt, m in cases[:5]]
    expected = [e[:m] for e, (_, m) in zip(expected, cases, strict=False)]
    llm = LLM(path, attention_backend="triton", max_num_batched_tokens=48, dtype="float32")
    assert type(llm.engine.runner.backend).__name__ == "TritonPagedAttention"
    assert generate_greedy(llm, cases) == expected
    assert generate_greedy(llm, cases) == expected
    assert llm.engine.kv.prefix_hits >= 300 + 130
    assert_kv_all_free(llm.engine)
