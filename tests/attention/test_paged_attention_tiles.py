"""The C++ kernel's bfloat16 cache on the AMX tile unit (csrc/paged_attention_amx.h and
paged_attention_amx_walk.h): on CPUs with AMX-BF16 every query row of every step takes it, q
and p rounded to bfloat16, K and V read where they lie (copied where a tile's 16 keys straddle
blocks or end early). Its agreement with dense attention on the cache's values, and batch
invariance: a row's bits alone, among other rows, and under another chunking of its prefill.
Skipped where the CPU lacks AMX-BF16 (tests/attention/test_kv_cache_quantized.py then checks
the float32 path on the same steps)."""

from __future__ import annotations

import pytest
import torch

from tests.attention.test_kv_cache_quantized import (
    MIXED,
    check_against_dense,
    quantized_step,
    run_quantized,
)
from tests.attention.test_paged_backends import dense_reference
from tokenmill.attention.cpu_kernels import bf16_on_tiles, paged_attention_op

needs_tiles = pytest.mark.skipif(paged_attention_op() is None or not bf16_on_tiles(64),
                                 reason="no AMX-BF16 tile unit (or no C++ toolchain)")


@needs_tiles
def test_tiles_take_heads_of_64_and_128_only():
    assert bf16_on_tiles(64) and bf16_on_tiles(128)
    assert not bf16_on_tiles(32) and not bf16_on_tiles(96) and not bf16_on_tiles(256)


@needs_tiles
@pytest.mark.parametrize("shape", [(16, 9, 3, 64), (8, 8, 2, 128), (4, 8, 1, 64),
                                   (16, 16, 2, 128), (16, 14, 2, 64)])
def test_tiles_mixed_step_against_dense(shape):
    """A mixed step (decodes of many lengths, fresh prefills, chunks over cached prefixes,
    five decodes sharing cached blocks) for block sizes 4-16 (tiles of 16 keys in place or
    copied), heads of 64 and 128, and G = 1..8 query heads per KV head (one to eight blocks
    of 16 columns): dense attention with q rounded as the kernel rounds it, to 2^-8."""
    bs, d = shape[0], shape[3]
    seqs = MIXED + [(4 * bs + 3, 1)] * 5 + [(70 + 9 * i, 1) for i in range(6)]
    cache, scales, batch, q, k_new, v_new, full_k, full_v = quantized_step(
        "bfloat16", shape, seqs, shared_prefix=4 * bs, seed=13)
    _, out = run_quantized("cpu", bs, cache, scales, batch, q, k_new, v_new)
    check_against_dense(out, batch, q, full_k, full_v, d, on_tiles=True)


def capped_reference(q, k, v, scale, cap):
    """dense_reference with Gemma 2's soft cap on the scores (q: the last rows of k's)."""
    L, Lq, g = k.shape[0], q.shape[0], q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    scores = cap * torch.tanh(scores / cap)
    mask = torch.arange(L)[None, :] > torch.arange(L - Lq, L)[:, None]
    return torch.einsum("hqk,khd->qhd", scores.masked_fill(mask, float("-inf")).softmax(-1), v)


def check_rows_bitwise_alone_together_and_rechunked(d, hq, hkv, cap, last_len, cut):
    """Batch-invariant mode (split_keys 512): a prefill chunk of 40 queries (positions 37-76),
    decodes of sequences sharing 32 cached blocks with it, two of them attending from keys 5
    and 21 (a cascade's own part: tiles of keys straddling blocks); every row bitwise the same
    alone, in the batch, and with the chunk cut in two at `cut`; and all of them dense
    attention's answer on the cache's values with q rounded to bf16, to 2^-8."""
    op = paged_attention_op()
    gen = torch.Generator().manual_seed(5)
    bs, nb = 16, 300
    k_cache = torch.randn(nb, bs, hkv, d, generator=gen).bfloat16()
    v_cache = torch.randn(nb, bs, hkv, d, generator=gen).bfloat16()
    ids = torch.randperm(nb - 1, generator=gen).add(1)
    tables = torch.cat([ids[:32].repeat(4, 1), ids[32:32 + 4 * 14].view(4, 14)], 1)
    # rows 0-39: sequence 0's queries at keys 37..76; then decodes of sequences 1-3 (1 and 2
    # share their first 32 blocks with 0; 3 too, as prefix caching leaves them)
    rows = torch.tensor([0] * 40 + [1, 2, 3])
    lens = torch.tensor(list(range(38, 78)) + [530, 611, last_len])
    starts = torch.tensor([0] * 40 + [5, 21, 0])
    q = torch.randn(len(rows), hq, d, generator=gen)
    scale = d ** -0.5

    def attend(idx):
        return op(q[idx], k_cache, v_cache, tables, rows[idx], starts[idx], lens[idx], scale,
                  None, cap, 512)

    out, lse = attend(torch.arange(len(rows)))
    for i in range(len(rows)):
        alone = attend(torch.tensor([i]))
        assert torch.equal(alone[0][0], out[i]) and torch.equal(alone[1][0], lse[i]), i
    first, second = attend(torch.arange(cut)), attend(torch.arange(cut, len(rows)))
    assert torch.equal(torch.cat([first[0], second[0]]), out)
    flat_k, flat_v = k_cache.float().view(-1, hkv, d), v_cache.float().view(-1, hkv, d)
    for i in range(len(rows)):
        n, start = int(lens[i]), int(starts[i])
        slots = (tables[rows[i]].repeat_interleave(bs) * bs
                 + torch.arange(bs).repeat(tables.shape[1]))[start:n]
        qb = q[i:i + 1].bfloat16().float()
        ref = (capped_reference(qb, flat_k[slots], flat_v[slots], scale, cap) if cap
               else dense_reference(qb, flat_k[slots], flat_v[slots], scale))
        torch.testing.assert_close(out[i:i + 1], ref, atol=2 ** -8, rtol=2 ** -8)


@needs_tiles
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("cap", [0.0, 8.0])
def test_tiles_rows_bitwise_alone_together_and_rechunked(d, cap):
    """check_rows_bitwise_alone_together_and_rechunked on the tile unit: G = 4, the tiles of
    16 keys that straddle blocks copied."""
    check_rows_bitwise_alone_together_and_rechunked(d, 8, 2, cap, 700, 17)
