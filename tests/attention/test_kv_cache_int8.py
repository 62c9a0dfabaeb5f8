"""The int8 KV cache: rows of int8 values with their float32 scale beside them (one per token
and KV head); quantize / dequantize error bounds; stores at slots; block copies carry the
scales; the PyTorch backend (the oracle) reads an int8 cache exactly as a float cache holding
the dequantized values; the real bytes per block set the capacity; backends that cannot read
it are refused."""

from __future__ import annotations

import pytest
import torch

from tests.attention.test_paged_backends import MIXED, build_step, dense_reference, run
from tokenmill.attention import get_attention_backend
from tokenmill.attention.kv_cache import (
    allocate_kv_cache,
    bytes_per_block,
    copy_blocks,
    dequantize_rows,
    on_grid,
    quantize_rows,
    store_kv,
)
from tokenmill.config import CacheConfig


def test_round_trip_error_is_at_most_half_a_step():
    x = torch.randn(50, 3, 64) * torch.logspace(-3, 3, 50)[:, None, None]
    rows = quantize_rows(x)
    assert rows.shape == (50, 3, 68) and rows.dtype == torch.int8
    step = x.abs().amax(-1, keepdim=True) / 127
    assert bool(((dequantize_rows(rows) - x).abs() <= step / 2 + 1e-6 * step).all())
    assert torch.equal(quantize_rows(on_grid(x)), rows)  # idempotent on its own grid
    assert torch.equal(dequantize_rows(quantize_rows(torch.zeros(2, 1, 8))), torch.zeros(2, 1, 8))


def test_store_and_block_copy_keep_values_and_scales_together():
    cache = allocate_kv_cache(2, 6, 4, 3, 16, torch.float32, torch.device("cpu"), "int8")
    assert cache.shape == (2, 2, 6, 4, 3, 20) and cache.dtype == torch.int8
    k, v = torch.randn(3, 3, 16), torch.randn(3, 3, 16) * 100
    store_kv(cache[1], k, v, torch.tensor([5, 6, 13]))  # block 1 offsets 1, 2; block 3 offset 1
    flat = cache[1].view(2, -1, 3, 20)
    torch.testing.assert_close(dequantize_rows(flat[1, [5, 6, 13]]), on_grid(v))
    assert not flat[:, [4, 7, 12]].any()  # other slots untouched (zero)
    copy_blocks(cache, [(1, 4)])
    assert torch.equal(cache[:, :, 4], cache[:, :, 1])
    torch.testing.assert_close(dequantize_rows(cache[1, 0, 4, 1:3]), on_grid(k[:2]))


def test_capacity_counts_the_real_bytes():
    f32 = bytes_per_block(30, 16, 3, 64, torch.float32)
    i8 = bytes_per_block(30, 16, 3, 64, torch.float32, "int8")
    assert (f32, i8) == (30 * 2 * 16 * 3 * 64 * 4, 30 * 2 * 16 * 3 * 68)
    assert 3.7 < f32 / i8 < 3.8


@pytest.mark.parametrize("shape", [(4, 6, 2, 8), (16, 9, 3, 64)])
def test_torch_backend_reads_int8_as_its_dequantized_values(shape):
    """A mixed step (decodes, fresh prefills, chunks over cached prefixes, a shared-prefix
    cascade) on an int8 cache: the same output as dense attention over the values the cache
    holds: the reference takes K/V on the int8 grid, as every path reads them (a fresh
    prefill's own k/v included)."""
    bs, hq, hkv, d = shape
    seqs = MIXED + [(4 * bs + 3, 1)] * 5  # the last five share 4 cached blocks
    cache, batch, q, k_new, v_new, full_k, full_v = build_step(bs, hq, hkv, d, seqs,
                                                               shared_prefix=4 * bs)
    full_k, full_v = [on_grid(k) for k in full_k], [on_grid(v) for v in full_v]
    cache8 = quantize_rows(cache)  # (2, nb, bs, hkv, d + 4): every cached row quantized
    meta, out = run("torch", bs, cache8, batch, q, k_new, v_new)
    assert any(g.shared_block_ids is not None for g in meta.decode_groups)  # cascade path
    for i in range(len(seqs)):
        s, e = batch.query_start_locs[i], batch.query_start_locs[i + 1]
        ref = dense_reference(q[s:e], full_k[i], full_v[i], d ** -0.5)
        torch.testing.assert_close(out[s:e], ref, atol=1e-5, rtol=1e-5)


def test_backends_that_cannot_read_it_are_refused():
    cpu = torch.device("cpu")
    assert type(get_attention_backend("auto", 16, cpu, torch.float32, "int8")).__name__ == \
        "TorchPagedAttention"
    for name in ("cpu", "triton"):
        with pytest.raises(ValueError, match="does not read an int8 KV cache"):
            get_attention_backend(name, 16, cpu, torch.float32, "int8")
    with pytest.raises(ValueError, match="fp8.*not built"):
        CacheConfig(kv_cache_dtype="fp8")
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        CacheConfig(kv_cache_dtype="int4")
