"""The C++ kernel's bfloat16 cache on AVX512-BF16's vdpbf16ps (csrc/paged_attention_keys_dp.h):
on CPUs with the instruction and no AMX tile unit, heads of 64 and 1-6 query heads per KV
head, q and p rounded to bfloat16, K and V read as stored. Its agreement with dense
attention on the cache's values, batch invariance (a row's bits alone, among other rows,
under another chunking of its prefill, with and without a soft cap), and the switch back to
the float32 path (which the float32 bounds then hold). Skipped on CPUs without AVX512-BF16
and on AMX ones (test_paged_attention_tiles.py: the tile unit takes these shapes there)."""

from __future__ import annotations

import pytest
import torch

from tests.attention.test_kv_cache_quantized import (
    MIXED,
    check_against_dense,
    quantized_step,
    run_quantized,
)
from tests.attention.test_paged_attention_tiles import (
    check_rows_bitwise_alone_together_and_rechunked,
)
from tokenmill.attention.cpu_kernels import bf16_on_tiles, bf16_rounds_qp, paged_attention_op
from tokenmill.utils.cpp_extension import load_cpu_extension

needs_dot = pytest.mark.skipif(
    paged_attention_op() is None or bf16_on_tiles(64) or not bf16_rounds_qp(64, 3),
    reason="no AVX512-BF16 (or AMX takes these shapes, or no C++ toolchain)")


@pytest.fixture
def dot_switch():
    """Sets the kernel's vdpbf16ps switch; restores it after the test."""
    module = load_cpu_extension("paged_attention_cpu")
    before = module.bf16_dot_attention(None)
    yield module.bf16_dot_attention
    module.bf16_dot_attention(before)


@needs_dot
def test_the_dot_path_takes_heads_of_64_in_groups_of_1_to_6():
    assert all(bf16_rounds_qp(64, g) for g in range(1, 7))
    assert not bf16_rounds_qp(64, 7) and not bf16_rounds_qp(64, 8)
    assert not bf16_rounds_qp(128, 4) and not bf16_rounds_qp(32, 2)


def mixed_step(shape):
    bs = shape[0]
    seqs = MIXED + [(4 * bs + 3, 1)] * 5 + [(70 + 9 * i, 1) for i in range(6)]
    return quantized_step("bfloat16", shape, seqs, shared_prefix=4 * bs, seed=13)


SHAPES = [(16, 9, 3, 64), (8, 8, 2, 64), (4, 4, 4, 64), (16, 12, 2, 64), (16, 10, 2, 64),
          (8, 5, 1, 64)]


@needs_dot
@pytest.mark.parametrize("shape", SHAPES)
def test_dot_mixed_step_against_dense(shape, dot_switch):
    """A mixed step (decodes of many lengths, fresh prefills, chunks over cached prefixes,
    five decodes sharing cached blocks: rows alone and rows of a group) for block sizes 4-16
    and G = 1..6: dense attention with q rounded as the kernel rounds it, to 2^-8. With the
    switch off, the float32 path's 1e-5 on the same step: a different answer."""
    bs, d = shape[0], shape[3]
    cache, scales, batch, q, k_new, v_new, full_k, full_v = mixed_step(shape)
    dot_switch(True)
    _, out = run_quantized("cpu", bs, cache, scales, batch, q, k_new, v_new)
    check_against_dense(out, batch, q, full_k, full_v, d, on_tiles=True)
    dot_switch(False)
    _, exact = run_quantized("cpu", bs, cache, scales, batch, q, k_new, v_new)
    check_against_dense(exact, batch, q, full_k, full_v, d, on_tiles=False)
    assert not torch.equal(out, exact)


@needs_dot
@pytest.mark.parametrize("cap", [0.0, 8.0])
def test_dot_rows_bitwise_alone_together_and_rechunked(cap, dot_switch):
    """check_rows_bitwise_alone_together_and_rechunked on vdpbf16ps, G = 3: the chunk's rows
    a group reading the tile's transposed keys, the decodes rows alone (keys transposed in
    registers), an odd key count (701: a last pair with a zero row)."""
    dot_switch(True)
    check_rows_bitwise_alone_together_and_rechunked(64, 9, 3, cap, 701, 23)
