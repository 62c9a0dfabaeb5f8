"""The Triton backend's split-KV decode (flash-decoding): decode tiles' keys cut into splits of
split_keys keys, attended in parallel and merged in order. Checked with small splits, so that
short test contexts take many of them: against dense attention and the PyTorch backend (sliding
windows, soft caps, int8 / fp8 caches), bit for bit against the unsplit kernel for a sequence
of one split, and batch-invariant (a sequence's output alone == within any batch)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.attention.test_paged_backends import (
    batch_to,
    build_step,
    dense_reference,
    kernel_device,
    run,
)
from tokenmill.attention import get_attention_backend
from tokenmill.attention.base import AttentionVariant
from tokenmill.attention.triton_paged import split_keys_for, triton_available

pytestmark = pytest.mark.skipif(not triton_available(), reason="triton not installed")

LONG = [(300, 1), (31, 1), (0, 5), (64, 1), (97, 1), (1, 1), (200, 9), (129, 1)]


def test_split_keys_keep_a_sequence_within_32_splits():
    assert split_keys_for(None) == 512 and split_keys_for(4096) == 512
    assert split_keys_for(16384) == 512  # 32 splits of 512
    assert split_keys_for(20000) == 1024 and split_keys_for(131072) == 4096
    for n in (1, 512, 16385, 100_000, 1 << 20):
        assert split_keys_for(n) % 512 == 0 and -(-n // split_keys_for(n)) <= 32


def triton_step(shape, seqs, split_keys, variant=None, seed=0):
    """(decode tiles' metadata, output on CPU, the step's tensors) of the Triton backend with
    splits of `split_keys` keys."""
    bs, hq, hkv, d = shape
    cache, batch, q, k_new, v_new, full_k, full_v = build_step(bs, hq, hkv, d, seqs, seed=seed)
    device = kernel_device("triton")
    backend = get_attention_backend("triton", bs, device,
                                    features=frozenset(variant or {}))
    backend.split_keys = split_keys
    meta = backend.build_metadata(batch_to(batch, device))
    layer = type("Layer", (), {"variant": AttentionVariant(d ** -0.5, **(variant or {})),
                               "kv_scales": None})
    out = backend.forward(layer, *(t.to(device) for t in (q, k_new, v_new)),
                          cache.clone().to(device), meta)
    return meta, out.view_as(q).cpu(), (batch, q, full_k, full_v)


@pytest.mark.parametrize("shape", [(4, 6, 2, 8), (16, 9, 3, 64), (8, 4, 1, 32),
                                   (16, 8, 8, 64)])
@pytest.mark.parametrize("split_keys", [32, 64])
def test_split_decode_matches_dense(shape, split_keys):
    meta, out, (batch, q, full_k, full_v) = triton_step(shape, LONG, split_keys)
    decode = meta.tiles[0]
    keys = [c + n for c, n in LONG if n == 1]
    # each decode tile has cdiv(keys, split_keys) work items, in split order
    assert decode.split.work_splits.tolist() == [s for n in keys
                                                for s in range(-(-n // split_keys))]
    assert max(decode.split.work_splits.tolist()) >= 3  # several splits really merged
    for i in range(len(LONG)):
        lo, hi = batch.query_start_locs[i], batch.query_start_locs[i + 1]
        want = dense_reference(q[lo:hi], full_k[i], full_v[i], shape[3] ** -0.5)
        torch.testing.assert_close(out[lo:hi], want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("variant", [{"sliding_window": 40}, {"soft_cap": 2.0},
                                     {"sliding_window": 100, "soft_cap": 5.0}])
def test_split_decode_with_windows_and_soft_caps_matches_torch(variant):
    shape = (8, 8, 2, 32)
    bs, hq, hkv, d = shape
    _, out, (batch, q, *_) = triton_step(shape, LONG, 32, variant)
    cache, batch, q, k_new, v_new, *_ = build_step(bs, hq, hkv, d, LONG)
    _, want = run("torch", bs, cache, batch, q, k_new, v_new,
                  features=frozenset(variant), **variant)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8", "float16"])
def test_split_decode_reads_quantized_caches(kv_dtype):
    """The split kernel on an int8 / fp8 / float16 cache equals the unsplit kernel on it (both
    read and dequantize the same bytes)."""
    from tokenmill.attention.kv_cache import allocate_kv_cache, allocate_kv_scales
    from tokenmill.attention.triton_kernels import paged_attention
    from tokenmill.attention.triton_kv_store import store_kv

    bs, hq, hkv, d = 8, 8, 2, 32
    device = kernel_device("triton")
    seqs = [(150, 1), (40, 1), (7, 1)]
    _, batch, q, k_new, v_new, full_k, full_v = build_step(bs, hq, hkv, d, seqs)
    num_blocks = max(max(r) for r in batch.block_tables.tolist()) + 1
    cache = allocate_kv_cache(1, num_blocks, bs, hkv, d, torch.float32, device, kv_dtype)[0]
    scales = allocate_kv_scales(1, hkv, device, kv_dtype)
    scales = None if scales is None else scales[0]
    tables = batch.block_tables
    for i, k in enumerate(full_k):  # every position of every sequence, stored quantized
        pos = torch.arange(k.shape[0])
        slots = tables[i][pos // bs] * bs + pos % bs
        store_kv(cache, k.to(device), full_v[i].to(device), slots.to(device), scales)
    backend = get_attention_backend("triton", bs, device)
    backend.split_keys = 32
    meta = backend.build_metadata(batch_to(batch, device))
    t = meta.tiles[0]
    outs = []
    for split in (t.split, None):
        out = torch.zeros_like(q).to(device)
        paged_attention(q.to(device), cache[0], cache[1], out, t.block_tables, t.rows,
                        t.q_starts, t.q_lens, t.first_ctx, 1, d ** -0.5, scales, None, None,
                        split)
        outs.append(out.cpu())
    torch.testing.assert_close(outs[0], outs[1], atol=1e-5, rtol=1e-5)


def test_one_split_is_the_unsplit_kernel_bit_for_bit():
    """A decode of one split (every context here < 512 keys) through the split kernel and its
    merge equals the unsplit kernel bit for bit; so a step whose decodes are all one split
    runs unsplit (no merge launch) and a CUDA graph's fixed split layout changes nothing."""
    from tokenmill.attention.triton_kernels import paged_attention
    from tokenmill.attention.triton_kv_store import store_kv

    bs, hq, hkv, d = 8, 6, 2, 16
    cache, batch, q, k_new, v_new, *_ = build_step(bs, hq, hkv, d, LONG)
    device = kernel_device("triton")
    backend = get_attention_backend("triton", bs, device)
    meta = backend.build_metadata(batch_to(batch, device))
    t = meta.tiles[0]
    assert t.split is None  # every decode is one split: the unsplit kernel
    split = backend._split_work(t.first_ctx.cpu().numpy().astype(np.int64))
    assert split.work_splits.max() == 0
    cache = cache.to(device)
    store_kv(cache, k_new.to(device), v_new.to(device), batch_to(batch, device).slot_mapping)
    outs = []
    for work in (None, split):
        out = torch.zeros_like(q).to(device)
        paged_attention(q.to(device), cache[0], cache[1], out, t.block_tables, t.rows,
                        t.q_starts, t.q_lens, t.first_ctx, 1, d ** -0.5, split=work)
        outs.append(out.cpu())
    decode_rows = [batch.query_start_locs[i] for i, (_, n) in enumerate(LONG) if n == 1]
    assert outs[0][decode_rows].abs().sum() > 0
    assert torch.equal(outs[0][decode_rows], outs[1][decode_rows])


def test_split_decode_is_batch_invariant():
    """A sequence's decode output alone equals it within a batch of other lengths, bit for
    bit (the cut depends on its own length): the same cache, the same query, one request."""
    from tokenmill.attention.input_batch import InputBatch
    from tokenmill.core.interface import ScheduledRequest
    from tokenmill.sampling_params import SamplingParams

    bs, hq, hkv, d = 8, 8, 2, 32
    decodes = [(c, n) for c, n in LONG if n == 1]
    cache, batch, q, k_new, v_new, *_ = build_step(bs, hq, hkv, d, decodes, seed=3)
    device = kernel_device("triton")
    layer = type("Layer", (), {"variant": AttentionVariant(d ** -0.5), "kv_scales": None})

    def attend(rows: list[int]) -> torch.Tensor:
        reqs = [ScheduledRequest(str(i), [0], decodes[i][0],
                                 batch.block_tables[i][:-(-(decodes[i][0] + 1) // bs)].tolist(),
                                 True, SamplingParams()) for i in rows]
        sub = InputBatch.build(reqs, bs, device)
        backend = get_attention_backend("triton", bs, device)
        backend.split_keys = 32
        out = backend.forward(layer, *(t[rows].to(device) for t in (q, k_new, v_new)),
                              cache.clone().to(device), backend.build_metadata(sub))
        return out.cpu()

    together = attend(list(range(len(decodes))))
    for i in (0, 3, 4):  # 300, 97 and 1 cached keys: 10, 4 and 1 splits
        assert torch.equal(attend([i])[0], together[i])
