"""Both paged-attention backends against dense causal attention over each sequence's full K/V.

A step mixes decodes of many lengths, a fresh prefill, prefill chunks over a cached prefix,
short chunks (the C++ kernel's multi-query path) and a decode group sharing a cached prefix
(cascade), with blocks scattered through the pool. The CPU kernel backend is also compared to
the PyTorch backend, its oracle, on the same step. Tolerance: 1e-5 absolute (float32).
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from tokenmill.attention import get_attention_backend
from tokenmill.attention.base import AttentionVariant
from tokenmill.attention.cpu_kernels import bf16_rounds_qp, paged_attention_op
from tokenmill.attention.input_batch import InputBatch
from tokenmill.attention.kv_cache import allocate_kv_cache
from tokenmill.attention.triton_paged import PREFILL_TILE, triton_available
from tokenmill.core.interface import ScheduledRequest
from tokenmill.sampling_params import SamplingParams

needs_kernel = pytest.mark.skipif(paged_attention_op() is None,
                                  reason="C++ toolchain unavailable")
needs_triton = pytest.mark.skipif(not triton_available(), reason="triton not installed")
# On a machine without CUDA the Triton kernel runs in Triton's interpreter (tests/conftest.py).
BACKENDS = ["torch", pytest.param("cpu", marks=needs_kernel),
            pytest.param("triton", marks=needs_triton)]
# (block_size, Hq, Hkv, D): GQA 3:1, GQA 2:1, MHA, MQA, a head dim that is not a multiple of 8
# (block size, Hq, Hkv, D). On AVX-512 builds the C++ kernel scores 4 keys at a time and
# accumulates V for the G = Hq / Hkv heads of a KV head together where G <= 6 (and D = 64 for
# V; csrc/paged_attention_groups.h): G = 1, 3, 4, 6, 8 and D = 16, 64, 128 take each mix.
SHAPES = [(4, 6, 2, 8), (16, 9, 3, 64), (4, 4, 4, 16), (8, 4, 1, 32), (4, 4, 2, 12),
          (16, 12, 2, 128), (8, 8, 1, 64), (16, 8, 8, 64)]


def dense_reference(q, k, v, scale):
    """q (Lq, Hq, D): the last Lq positions of a sequence whose full K/V are k, v (L, Hkv, D)."""
    L, Lq = k.shape[0], q.shape[0]
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    q_pos = torch.arange(L - Lq, L)[:, None]
    scores = scores.masked_fill(torch.arange(L)[None, :] > q_pos, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def assert_attention_close(out, q, k, v, scale, on_tiles=False):
    """out (Lq, Hq, D) against dense_reference, to 1e-5. Where the kernel rounds q and p (a
    bfloat16 cache on the AMX tile unit or on vdpbf16ps: cpu_kernels.bf16_rounds_qp) against q
    rounded to bfloat16 as the kernel rounds it, to 2^-8 absolute and relative: the rest is
    p's rounding (2^-9 relative each)."""
    if on_tiles:
        ref = dense_reference(q.bfloat16().float(), k, v, scale)
        torch.testing.assert_close(out, ref, atol=2 ** -8, rtol=2 ** -8)
    else:
        torch.testing.assert_close(out, dense_reference(q, k, v, scale), atol=1e-5, rtol=1e-5)


def build_step(bs, hq, hkv, d, seqs, shared_prefix=0, seed=0, consecutive_shared=False):
    """seqs: (context already cached, new tokens). The last 5 sequences share `shared_prefix`
    cached tokens (same blocks), as prefix caching would leave them: scattered block ids, or
    consecutive ones (a fresh pool's order)."""
    torch.manual_seed(seed)
    num_blocks = sum(-(-(c + n) // bs) for c, n in seqs) + 2
    cache = allocate_kv_cache(1, num_blocks, bs, hkv, d, torch.float32, torch.device("cpu"))[0]
    flat = cache.view(2, -1, hkv, d)
    perm = torch.randperm(num_blocks - 1).add(1).tolist()  # scattered block ids, never 0
    shared_blocks = [perm.pop() for _ in range(shared_prefix // bs)]
    if consecutive_shared:
        n = len(shared_blocks)
        perm += shared_blocks
        shared_blocks = list(range(3, 3 + n))
        perm = [b for b in perm if b not in shared_blocks]
    shared_k = torch.randn(shared_prefix, hkv, d)
    shared_v = torch.randn(shared_prefix, hkv, d)
    full_k, full_v, reqs = [], [], []
    for i, (cached, new) in enumerate(seqs):
        total = cached + new
        share = shared_prefix if i >= len(seqs) - 5 and shared_prefix else 0
        blocks = shared_blocks[:] if share else []
        blocks += [perm.pop() for _ in range(-(-total // bs) - len(blocks))]
        k, v = torch.randn(total, hkv, d), torch.randn(total, hkv, d)
        if share:
            k[:share], v[:share] = shared_k, shared_v
        full_k.append(k)
        full_v.append(v)
        for pos in range(cached):  # pretend earlier steps wrote the cached context
            slot = blocks[pos // bs] * bs + pos % bs
            flat[0, slot], flat[1, slot] = k[pos], v[pos]
        reqs.append(ScheduledRequest(str(i), [0] * new, cached, blocks, True,
                                     SamplingParams()))
    batch = InputBatch.build(reqs, bs, torch.device("cpu"))
    q = torch.randn(batch.num_tokens, hq, d)
    k_new = torch.cat([k[c:] for k, (c, _) in zip(full_k, seqs, strict=True)])
    v_new = torch.cat([v[c:] for v, (c, _) in zip(full_v, seqs, strict=True)])
    return cache, batch, q, k_new, v_new, full_k, full_v


def kernel_device(backend_name: str) -> torch.device:
    """Where a backend runs in these tests: Triton compiled on a GPU when there is one (else in
    its interpreter on CPU tensors), the others on the CPU."""
    cuda = backend_name == "triton" and torch.cuda.is_available()
    return torch.device("cuda" if cuda else "cpu")


def batch_to(batch: InputBatch, device: torch.device) -> InputBatch:
    return dataclasses.replace(batch, **{
        f.name: getattr(batch, f.name).to(device) for f in dataclasses.fields(batch)
        if isinstance(getattr(batch, f.name), torch.Tensor)})


def run(backend_name, bs, cache, batch, q, k_new, v_new, kv_scales=None,
        features=frozenset(), **variants):
    """One step's attention by the backend on its device (kernel_device); (metadata, output
    on the CPU). `variants`: the layer's sliding_window / soft_cap."""
    device = kernel_device(backend_name)
    batch = batch_to(batch, device)
    cache, q, k_new, v_new = (t.to(device) for t in (cache, q, k_new, v_new))
    kv_scales = None if kv_scales is None else kv_scales.to(device)
    backend = get_attention_backend(backend_name, bs, device, features=features)
    meta = backend.build_metadata(batch)
    layer = SimpleNamespace(variant=AttentionVariant(q.shape[-1] ** -0.5, **variants),
                            kv_scales=kv_scales)
    out = backend.forward(layer, q, k_new, v_new, cache.clone(), meta)
    return meta, out.view_as(q).cpu()


MIXED = [(9, 1), (0, 7), (13, 6), (3, 1), (0, 1), (30, 1), (5, 3), (0, 2), (21, 8), (40, 20),
         (64, 1), (17, 1)]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("shape", SHAPES)
def test_paged_matches_dense_for_mixed_step(backend, shape):
    bs, hq, hkv, d = shape
    cache, batch, q, k_new, v_new, full_k, full_v = build_step(bs, hq, hkv, d, MIXED)
    meta, out = run(backend, bs, cache, batch, q, k_new, v_new)
    if backend == "cpu":  # every query goes to the kernel, chunks of any length too
        assert meta.paged.seq_rows.numel() == batch.num_tokens
    if backend == "triton":  # one launch of decode tiles, one of prefill tiles
        decode, chunks = meta.tiles
        assert decode.tile == 1 and decode.rows.tolist() == [0, 3, 4, 5, 10, 11]
        assert chunks.tile == PREFILL_TILE
        assert chunks.q_lens.tolist() == [7, 6, 3, 2, 8, 16, 4]  # (40, 20) in two tiles
        assert chunks.first_ctx.tolist() == [1, 14, 6, 1, 22, 41, 57]
    for i in range(len(MIXED)):
        s, e = batch.query_start_locs[i], batch.query_start_locs[i + 1]
        ref = dense_reference(q[s:e], full_k[i], full_v[i], d ** -0.5)
        torch.testing.assert_close(out[s:e], ref, atol=1e-5, rtol=1e-5)


@needs_kernel
@pytest.mark.parametrize("num_decodes", [1, 3, 64])  # batch 1 splits work by head
@pytest.mark.parametrize("consecutive", [False, True])  # shared block ids scattered / in order
@pytest.mark.parametrize("members", ["decodes", "decodes+chunks"])
@pytest.mark.parametrize("invariant", [False, True])
def test_kernel_matches_torch_backend_with_shared_prefix(num_decodes, consecutive, members,
                                                         invariant):
    """Decodes in shuffled length order, then 5 sequences sharing a 480-token cached prefix:
    decodes only, or decodes with prefill chunks that start right after the prefix (480, 64),
    later (520, 30), and a long one (500, 300). The kernel (whose work items read shared
    blocks once for the rows sharing them) against the PyTorch backend and dense attention."""
    bs, hq, hkv, d = 16, 9, 3, 64
    lens = [30 + 3 * i for i in range(num_decodes)]
    lens = lens[::2] + lens[1::2]
    sharing = ([(600 + i, 1) for i in range(5)] if members == "decodes"
               else [(600, 1), (480, 64), (601, 1), (520, 30), (500, 300)])
    seqs = [(n, 1) for n in lens] + sharing
    step = build_step(bs, hq, hkv, d, seqs, shared_prefix=480, seed=num_decodes,
                      consecutive_shared=consecutive)
    cache, batch, q, k_new, v_new, full_k, full_v = step
    _, out_t = run("torch", bs, cache, batch, q, k_new, v_new)
    features = frozenset({"batch_invariant"}) if invariant else frozenset()
    meta_c, out_c = run("cpu", bs, cache, batch, q, k_new, v_new, features=features)
    assert meta_c.paged.seq_rows.numel() == batch.num_tokens
    torch.testing.assert_close(out_c, out_t, atol=1e-5, rtol=1e-5)
    for i in range(len(seqs)):
        s, e = batch.query_start_locs[i], batch.query_start_locs[i + 1]
        ref = dense_reference(q[s:e], full_k[i], full_v[i], d ** -0.5)
        torch.testing.assert_close(out_c[s:e], ref, atol=1e-5, rtol=1e-5)


def test_unknown_backend_is_rejected():
    with pytest.raises(ValueError, match="unknown attention backend 'flash'"):
        get_attention_backend("flash", 16, torch.device("cpu"))


@pytest.mark.parametrize("backend", BACKENDS)
def test_pure_decode_step_in_shuffled_length_order(backend):
    """Every query is a decode: the kernel path takes q without a gather, so its metadata
    must follow the flat batch's order, not the length grouping's."""
    bs, hq, hkv, d = 16, 9, 3, 64
    lens = [5 + 11 * i for i in range(20)]
    seqs = [(n, 1) for n in lens[::3] + lens[1::3] + lens[2::3]]
    cache, batch, q, k_new, v_new, full_k, full_v = build_step(bs, hq, hkv, d, seqs)
    _, out = run(backend, bs, cache, batch, q, k_new, v_new)
    for i in range(len(seqs)):
        ref = dense_reference(q[i:i + 1], full_k[i], full_v[i], d ** -0.5)
        torch.testing.assert_close(out[i:i + 1], ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("cached", [[1000], [700, 0], [900, 1, 50]])
@pytest.mark.parametrize("backend", BACKENDS)
def test_few_long_decodes_split_keys_across_threads(backend, cached):
    """With few rows the kernel splits each row's keys into chunks merged by log-sum-exp;
    a short row next to a long one gets empty chunks, which must contribute nothing."""
    bs, hq, hkv, d = 16, 9, 3, 64
    seqs = [(n, 1) for n in cached]
    cache, batch, q, k_new, v_new, full_k, full_v = build_step(bs, hq, hkv, d, seqs, seed=3)
    _, out = run(backend, bs, cache, batch, q, k_new, v_new)
    for i in range(len(seqs)):
        ref = dense_reference(q[i:i + 1], full_k[i], full_v[i], d ** -0.5)
        torch.testing.assert_close(out[i:i + 1], ref, atol=1e-5, rtol=1e-5)


@needs_triton
def test_triton_kernel_in_half_precision():
    """16-bit K/V and queries (products in fp16, accumulation in float32), against the float32
    dense reference. (Triton's CPU interpreter multiplies bf16 wrongly, so fp16 stands for the
    16-bit path here; on CUDA the kernel is the same for both.)"""
    cache, batch, q, k_new, v_new, full_k, full_v = build_step(16, 9, 3, 64, MIXED)
    half = lambda t: t.to(torch.float16)
    _, out = run("triton", 16, half(cache), batch, half(q), half(k_new), half(v_new))
    assert out.dtype == torch.float16
    for i in range(len(MIXED)):
        s, e = batch.query_start_locs[i], batch.query_start_locs[i + 1]
        ref = dense_reference(q[s:e], full_k[i], full_v[i], 64 ** -0.5)
        torch.testing.assert_close(out[s:e].float(), ref, atol=4e-3, rtol=4e-3)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("split_keys", [512, 0])
def test_kernel_rows_are_bitwise_the_same_alone_or_grouped(dtype, split_keys):
    """Consecutive query rows of one sequence (a prefill chunk's) walk their keys together in
    the kernel, up to 16 at a time (csrc/paged_attention_cpu.h: attend_keys); a row's result
    must not depend on that: each row alone, with its chunk, or among other sequences' rows,
    bitwise. Contexts past 512 keys give rows several chunks (split_keys 512) of which some
    rows of a group have one more."""
    op = paged_attention_op()
    gen = torch.Generator().manual_seed(5)
    bs, hkv, hq, d, nb = 16, 3, 9, 64, 160
    k_cache = torch.randn(nb, bs, hkv, d, generator=gen).to(dtype)
    v_cache = torch.randn(nb, bs, hkv, d, generator=gen).to(dtype)
    tables = torch.randperm(nb, generator=gen)[:3 * 50].view(3, 50)
    rows, starts, lens = [], [], []
    for seq, start, ends in ((0, 0, range(500, 530)), (1, 0, [90]), (2, 40, range(700, 720))):
        for end in ends:
            rows.append(seq), starts.append(start), lens.append(end)
    q = torch.randn(len(rows), hq, d, generator=gen)
    args = [torch.tensor(v) for v in (rows, starts, lens)]

    def attend(idx):
        out, lse = op(q[idx], k_cache, v_cache, tables, *(a[idx] for a in args), d ** -0.5,
                      None, 0.0, split_keys)
        return out, lse

    together = attend(torch.arange(len(rows)))
    # the sequences' rows interleaved: no two neighbours share a sequence, no row is grouped
    order = torch.tensor([i for pair in zip(range(30), range(31, 51), strict=False)
                          for i in pair] + list(range(20, 31)))
    apart = attend(order)
    assert torch.equal(apart[0], together[0][order]) and torch.equal(apart[1], together[1][order])
    if split_keys:  # invariant mode: a row alone too (split_keys 0 splits a lone row's keys)
        for i in (0, 13, 29, 30, 31, 45, 50):
            alone = attend(torch.tensor([i]))
            assert torch.equal(alone[0][0], together[0][i]), i
            assert torch.equal(alone[1][0], together[1][i]), i


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_rows_sharing_cached_blocks_are_bitwise_the_same_alone(dtype):
    """Decodes of sequences whose contexts start with the same cached blocks (a shared
    prompt) go in one work item, each tile of the shared blocks read once for all of them
    (csrc/paged_attention_cpu.h: attend_runs); a sequence sharing fewer blocks and a prefill
    chunk of another sequence sit among them. Batch-invariant mode (split_keys 512): every
    row bitwise as alone and in any order, and all of them dense attention's answer."""
    op = paged_attention_op()
    gen = torch.Generator().manual_seed(7)
    bs, hkv, hq, d, nb, seqs = 16, 3, 9, 64, 1000, 12
    k_cache = torch.randn(nb, bs, hkv, d, generator=gen).to(dtype)
    v_cache = torch.randn(nb, bs, hkv, d, generator=gen).to(dtype)
    ids = torch.randperm(nb - 1, generator=gen).add(1)
    tables = torch.cat([ids[:40].repeat(seqs, 1), ids[40:40 + seqs * 40].view(seqs, 40)], 1)
    tables[5, 30:] = ids[600:650]  # sequence 5 shares 30 blocks, not 40
    rows = torch.tensor(list(range(seqs)) + [3] * 20)
    lens = torch.tensor([650 + 7 * i for i in range(seqs)] + list(range(900, 920)))
    starts = torch.zeros_like(rows)
    q = torch.randn(len(rows), hq, d, generator=gen)

    def attend(idx):
        return op(q[idx], k_cache, v_cache, tables, rows[idx], starts[idx], lens[idx],
                  d ** -0.5, None, 0.0, 512)

    out, lse = attend(torch.arange(len(rows)))
    for i in range(len(rows)):
        alone = attend(torch.tensor([i]))
        assert torch.equal(alone[0][0], out[i]) and torch.equal(alone[1][0], lse[i]), i
    order = torch.randperm(len(rows), generator=gen)
    assert torch.equal(attend(order)[0], out[order])
    flat_k = k_cache.float().view(-1, hkv, d)
    flat_v = v_cache.float().view(-1, hkv, d)
    for i in range(len(rows)):
        n = int(lens[i])
        slots = (tables[rows[i]].repeat_interleave(bs) * bs
                 + torch.arange(bs).repeat(tables.shape[1]))[:n]
        assert_attention_close(out[i:i + 1], q[i:i + 1], flat_k[slots], flat_v[slots], d ** -0.5,
                               on_tiles=dtype == torch.bfloat16 and bf16_rounds_qp(d, hq // hkv))


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_lone_long_row_is_the_same_at_any_thread_count(dtype):
    """The kernel cuts a lone decode's work into items by the thread count (its KV heads, its
    chunks of keys: csrc/paged_attention_cpu.h). In batch-invariant mode (split_keys 512) the
    row's bits must not depend on it; with split_keys 0 the chunks follow the threads, and
    every cut must still be attention."""
    op = paged_attention_op()
    gen = torch.Generator().manual_seed(11)
    bs, hkv, hq, d, nb = 16, 4, 16, 64, 200
    k_cache = torch.randn(nb, bs, hkv, d, generator=gen).to(dtype)
    v_cache = torch.randn(nb, bs, hkv, d, generator=gen).to(dtype)
    tables = torch.randperm(nb, generator=gen)[:100].view(1, 100)
    q = torch.randn(1, hq, d, generator=gen)
    one, zero, ctx = torch.tensor([0]), torch.tensor([0]), torch.tensor([1500])
    threads = torch.get_num_threads()
    try:
        outs = {}
        for split_keys in (512, 0):
            for n in (1, 2, 8):  # 1500 keys: 3 chunks of 512
                torch.set_num_threads(n)
                outs[split_keys, n] = op(q, k_cache, v_cache, tables, one, zero, ctx,
                                         d ** -0.5, None, 0.0, split_keys)
    finally:
        torch.set_num_threads(threads)
    for n in (2, 8):
        assert torch.equal(outs[512, n][0], outs[512, 1][0]), n
        assert torch.equal(outs[512, n][1], outs[512, 1][1]), n
    slots = (tables[0].repeat_interleave(bs) * bs + torch.arange(bs).repeat(100))[:1500]
    flat_k, flat_v = k_cache.float().view(-1, hkv, d), v_cache.float().view(-1, hkv, d)
    for out, _ in outs.values():
        assert_attention_close(out, q, flat_k[slots], flat_v[slots], d ** -0.5,
                               on_tiles=dtype == torch.bfloat16 and bf16_rounds_qp(d, hq // hkv))


@needs_kernel
@pytest.mark.parametrize("hq,hkv,d", [(16, 2, 128), (8, 2, 128), (10, 2, 80), (8, 8, 64),
                                      (8, 1, 64), (6, 2, 48)])
def test_a_lone_row_reading_a_bf16_cache_in_place_matches_its_group(hq, hkv, d):
    """A row walking its keys alone (a decode) reads a bf16 cache's K and V rows where they
    lie and widens them in registers (csrc/paged_attention_raw.h; on AVX-512 D = 64 with G <=
    6 through paged_attention_keys_t.h), while the rows of a group (a prefill chunk's) share
    each tile widened once: the same arithmetic, so the same bits, at the head sizes and
    groups of query heads those paths take (D a multiple of 16; G = 1 .. 8; Llama-3.1-8B's
    D = 128, G = 4 among them), and attention."""
    op = paged_attention_op()
    gen = torch.Generator().manual_seed(13)
    bs, nb, rows = 16, 80, 16
    k_cache = torch.randn(nb, bs, hkv, d, generator=gen).bfloat16()
    v_cache = torch.randn(nb, bs, hkv, d, generator=gen).bfloat16()
    tables = torch.randperm(nb, generator=gen)[:60].view(1, 60)
    q = torch.randn(rows, hq, d, generator=gen)
    seq = starts = torch.zeros(rows, dtype=torch.long)  # one sequence from its first key
    lens = torch.arange(900, 900 + rows)  # a 16-row prefill chunk's queries

    def attend(i, j):
        return op(q[i:j], k_cache, v_cache, tables, seq[i:j], starts[i:j], lens[i:j],
                  d ** -0.5, None, 0.0, 512)

    together = attend(0, rows)
    slots = tables[0].repeat_interleave(bs) * bs + torch.arange(bs).repeat(60)
    flat_k, flat_v = k_cache.float().view(-1, hkv, d), v_cache.float().view(-1, hkv, d)
    for i in (0, 7, 15):
        alone = attend(i, i + 1)
        assert torch.equal(alone[0][0], together[0][i]), i
        assert torch.equal(alone[1][0], together[1][i]), i
        n = int(lens[i])
        assert_attention_close(alone[0], q[i:i + 1], flat_k[slots[:n]], flat_v[slots[:n]],
                               d ** -0.5, on_tiles=bf16_rounds_qp(d, hq // hkv))
