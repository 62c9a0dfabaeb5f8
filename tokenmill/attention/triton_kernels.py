"""The Triton kernels of the GPU backend: paged attention over query tiles straight from the
paged KV cache (the store that fills it: attention/triton_kv_store.py).

One program attends one tile (up to TILE consecutive queries of one sequence) for one KV head:
the tile's queries x the G query heads of that KV head form the rows of one matrix, so every
K/V block is read once per tile and used by all of them (grouped-query attention without
expanding K/V). Keys are walked in BLOCK_N-token steps through the sequence's block table
(each key's block looked up, so the cache's block size need not divide BLOCK_N), with an
online softmax; query j of a tile whose first query sees `first_ctx` cached tokens attends
keys [0, first_ctx + j). Decode is the TILE = 1 case; prefill chunks over a cached prefix (or
none) use a larger TILE. The same function runs on CUDA and, under TRITON_INTERPRET=1, on CPU
tensors, which is how the tests check it against the PyTorch backend without a GPU.

A sliding window (WINDOW > 0) limits each row to the keys at positions > its own - WINDOW, and
the key loop starts at the first block any row of the tile sees; a soft cap (HAS_CAP) turns
scores into cap * tanh(score / cap) before the mask (tanh as 2 sigmoid(2x) - 1).

A quantized cache (attention/kv_cache.py) is read in place and dequantized as it is loaded:
int8 rows (D values, then their float32 scale's 4 bytes, read through a float pointer) or fp8
e4m3 bytes (decoded by moving their bits into a float32's, times 2^120, times the KV head's
scale: exact, and the same on every GPU and in the interpreter), then the float32 math is the
same as for a float cache.

Invariants: q, out (T, Hq, D) with unit stride in D; the layer's cache halves are contiguous
(num_blocks, block_size, Hkv, R); float32 inputs use IEEE float32 products (no TF32), so
results match the PyTorch oracle to float32 rounding.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

from tokenmill.attention.kv_formats import KV_FORMATS, format_of_storage

if TYPE_CHECKING:
    from tokenmill.attention.triton_paged import SplitWork

# KV_FORMAT: the cache's row format (attention/kv_formats.py's kernel ids)
FLOAT, INT8, FP8, BF16 = (KV_FORMATS[n].kernel_id for n in ("auto", "int8", "fp8", "bfloat16"))
# 2^120: e4m3's bias (7) to float32's (127); constexpr, as every global a kernel reads
_FP8_REBIAS = tl.constexpr(1.329227995784916e36)


@triton.jit
def e4m3_to_float32(u):
    """e4m3 bytes (as int32) → their float32 values: the bits moved into a float32's, times
    2^120 (exact, subnormals too; the same on every GPU and in the interpreter). Also read by
    the block-fp8 GEMM (quantization/triton_block_gemm.py)."""
    bits = ((u & 0x7F) << 20) | ((u & 0x80) << 24)
    return bits.to(tl.float32, bitcast=True) * _FP8_REBIAS


@triton.jit
def _load_kv_rows(cache_ptr, row, head_scale, d, mask, n_ok, D: tl.constexpr,
                  ROW: tl.constexpr, KV_FORMAT: tl.constexpr):
    """(BLOCK_N, D_PAD) float32 values of cache rows `row` (BLOCK_N,) in the cache's format."""
    x = tl.load(cache_ptr + row[:, None] * ROW + d[None, :], mask=mask, other=0)
    if KV_FORMAT == 1:  # int8 values, then their float32 scale
        scale_ptr = (cache_ptr + row * ROW + D).to(tl.pointer_type(tl.float32))
        row_scale = tl.load(scale_ptr, mask=n_ok, other=0.0)
        x = x.to(tl.float32) * row_scale[:, None]
    elif KV_FORMAT == 2:  # e4m3 bytes (read as uint8)
        x = e4m3_to_float32(x.to(tl.int32)) * head_scale
    return x


@triton.jit
def _paged_attention_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, kv_scales_ptr,
    block_tables_ptr, tile_rows_ptr, tile_q_starts_ptr, tile_q_lens_ptr, tile_first_ctx_ptr,
    work_tiles_ptr, work_splits_ptr, part_acc_ptr, part_ml_ptr, split_keys,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_bt,
    scale, block_size, window, soft_cap,
    G: tl.constexpr, G_PAD: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr,
    D_PAD: tl.constexpr, TILE: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr, ROW: tl.constexpr, KV_FORMAT: tl.constexpr,
    HAS_WINDOW: tl.constexpr, HAS_CAP: tl.constexpr, SPLIT: tl.constexpr,
):
    kv_head = tl.program_id(1)
    if SPLIT:  # program 0's axis walks work items: (tile, split of split_keys keys)
        item = tl.program_id(0)
        tile = tl.load(work_tiles_ptr + item)
        split = tl.load(work_splits_ptr + item)
    else:
        tile = tl.program_id(0)
    seq_row = tl.load(tile_rows_ptr + tile)
    q_start = tl.load(tile_q_starts_ptr + tile)
    q_len = tl.load(tile_q_lens_ptr + tile)
    first_ctx = tl.load(tile_first_ctx_ptr + tile)

    # Row r of the tile's matrix: query r // G_PAD, head kv_head * G + r % G_PAD.
    rows = tl.arange(0, ROWS)
    qi = rows // G_PAD
    g = rows % G_PAD
    row_ok = (qi < q_len) & (g < G) & (qi < TILE)
    d = tl.arange(0, D_PAD)
    d_ok = d < D
    q_off = (q_start + qi)[:, None] * stride_qt + (kv_head * G + g)[:, None] * stride_qh
    q = tl.load(q_ptr + q_off + d[None, :], mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    sees = first_ctx + qi  # (ROWS,) keys [0, sees) for each row

    m_i = tl.full((ROWS,), -1.0e30, tl.float32)  # finite: a row with no key yet stays NaN-free
    l_i = tl.zeros((ROWS,), tl.float32)
    acc = tl.zeros((ROWS, D_PAD), tl.float32)
    kv_len = first_ctx + q_len - 1
    k_scale = 1.0
    v_scale = 1.0
    if KV_FORMAT == 2:  # fp8: this KV head's fixed scales
        k_scale = tl.load(kv_scales_ptr + kv_head)
        v_scale = tl.load(kv_scales_ptr + HKV + kv_head)
    lo = 0
    hi = kv_len
    if SPLIT:  # this item's keys only (past the end: a padding item, nothing to do)
        lo = split * split_keys
        hi = tl.minimum(lo + split_keys, kv_len)
    if HAS_WINDOW:  # the tile's first query sees keys from first_ctx - window on
        lo = tl.maximum(lo, tl.maximum(first_ctx - window, 0) // BLOCK_N * BLOCK_N)
    for n0 in range(lo, hi, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        n_ok = n < hi
        block = tl.load(block_tables_ptr + seq_row * stride_bt + n // block_size, mask=n_ok,
                        other=0)
        slot = block.to(tl.int64) * block_size + n % block_size
        row = slot * HKV + kv_head
        kv_mask = n_ok[:, None] & d_ok[None, :]
        k = _load_kv_rows(k_cache_ptr, row, k_scale, d, kv_mask, n_ok, D, ROW, KV_FORMAT)
        v = _load_kv_rows(v_cache_ptr, row, v_scale, d, kv_mask, n_ok, D, ROW, KV_FORMAT)
        k = k.to(q.dtype)  # (BLOCK_N, D_PAD)
        v = v.to(q.dtype)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale  # (ROWS, BLOCK_N)
        if HAS_CAP:
            s = soft_cap * (2.0 * tl.sigmoid(2.0 * s / soft_cap) - 1.0)
        visible = (n[None, :] < sees[:, None]) & n_ok[None, :]
        if HAS_WINDOW:
            visible &= n[None, :] >= sees[:, None] - window
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new

    if SPLIT:  # the split's unnormalised sums, merged by _merge_splits_kernel
        if split * split_keys < kv_len:
            head = (item * HKV + kv_head) * G + g  # (ROWS,) row of (items, Hq)
            tl.store(part_acc_ptr + head[:, None] * D_PAD + d[None, :], acc,
                     mask=row_ok[:, None])
            tl.store(part_ml_ptr + head * 2, m_i, mask=row_ok)
            tl.store(part_ml_ptr + head * 2 + 1, l_i, mask=row_ok)
    else:
        out = acc / tl.where(row_ok, l_i, 1.0)[:, None]
        o_off = (q_start + qi)[:, None] * stride_ot + (kv_head * G + g)[:, None] * stride_oh
        tl.store(out_ptr + o_off + d[None, :], out.to(out_ptr.dtype.element_ty),
                 mask=row_ok[:, None] & d_ok[None, :])


@triton.jit
def _merge_splits_kernel(out_ptr, part_acc_ptr, part_ml_ptr, tile_q_starts_ptr,
                         tile_first_ctx_ptr, tile_work_start_ptr, split_keys, stride_ot,
                         stride_oh, HQ: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr):
    """One decode tile's query head: its splits' (acc, m, l) merged in split order, as the
    online softmax would have continued (one split: acc * 1 / (l * 1), the unsplit kernel's
    acc / l)."""
    tile = tl.program_id(0)
    h = tl.program_id(1)
    start = tl.load(tile_work_start_ptr + tile)
    num = (tl.load(tile_first_ctx_ptr + tile) + split_keys - 1) // split_keys
    # loop-carried values start as tensors (compiled Triton keeps a loop variable's type)
    row = start * HQ + h
    m = tl.load(part_ml_ptr + row * 2)
    for i in range(1, num):
        m = tl.maximum(m, tl.load(part_ml_ptr + ((start + i) * HQ + h) * 2))
    d = tl.arange(0, D_PAD)
    w = tl.exp(tl.load(part_ml_ptr + row * 2) - m)
    total = tl.load(part_ml_ptr + row * 2 + 1) * w
    acc = tl.load(part_acc_ptr + row * D_PAD + d) * w
    for i in range(1, num):
        row = (start + i) * HQ + h
        w = tl.exp(tl.load(part_ml_ptr + row * 2) - m)
        total = total + tl.load(part_ml_ptr + row * 2 + 1) * w
        acc = acc + tl.load(part_acc_ptr + row * D_PAD + d) * w
    q = tl.load(tile_q_starts_ptr + tile)
    tl.store(out_ptr + q * stride_ot + h * stride_oh + d,
             (acc / total).to(out_ptr.dtype.element_ty), mask=d < D)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    out: torch.Tensor, block_tables: torch.Tensor, tile_rows: torch.Tensor,
                    tile_q_starts: torch.Tensor, tile_q_lens: torch.Tensor,
                    tile_first_ctx: torch.Tensor, tile: int, scale: float,
                    kv_scales: torch.Tensor | None = None, sliding_window: int | None = None,
                    soft_cap: float | None = None, split: SplitWork | None = None) -> None:
    """Write into out (T, Hq, D) the attention of the queries of every tile.

    q (T, Hq, D); k_cache, v_cache (num_blocks, block_size, Hkv, R), contiguous, in any
    format of kv_cache.py (kv_scales (2, Hkv) float32: an fp8 cache's);
    block_tables (B, max_blocks); tile_* (N,) int32: the sequence row, first flat query index,
    number of queries (1..tile) and cached tokens seen by the first query of each tile.
    split (decode tiles, tile = 1): the tiles' keys cut into work items of split_keys keys,
    attended in parallel and merged in order (flash-decoding).
    """
    num_tiles = tile_rows.numel()
    if num_tiles == 0:
        return
    _, Hq, D = q.shape
    _, block_size, Hkv, row = k_cache.shape
    assert k_cache.is_contiguous() and v_cache.is_contiguous(), "cache halves must be contiguous"
    k_cache, v_cache, kv_scales, kv_format = cache_args(k_cache, v_cache, kv_scales)
    assert q.stride(2) == 1 and out.stride(2) == 1
    assert split is None or (tile == 1 and split.split_keys % 32 == 0)
    G = Hq // Hkv
    g_pad = triton.next_power_of_2(G)
    d_pad = max(16, triton.next_power_of_2(D))
    rows = max(16, tile * g_pad)  # tl.dot needs 16+ rows; extra rows are masked
    if split is None:
        grid, work = (num_tiles, Hkv), (tile_rows, tile_rows, q, q, 0)  # (work args unread)
    else:
        items = split.work_tiles.numel()
        part_acc = torch.empty(items, Hq, d_pad, dtype=torch.float32, device=q.device)
        part_ml = torch.empty(items, Hq, 2, dtype=torch.float32, device=q.device)
        grid = (items, Hkv)
        work = (split.work_tiles, split.work_splits, part_acc, part_ml, split.split_keys)
    _paged_attention_kernel[grid](
        q, k_cache, v_cache, out, kv_scales,
        block_tables, tile_rows, tile_q_starts, tile_q_lens, tile_first_ctx, *work,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        scale, block_size, sliding_window or 0, soft_cap or 1.0,
        G=G, G_PAD=g_pad, HKV=Hkv, D=D, D_PAD=d_pad,
        TILE=tile, ROWS=rows, BLOCK_N=64 if tile > 1 else 32,
        # float32: exact products (Triton's default on GPU would be TF32); bf16 / fp16: default
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        ROW=row, KV_FORMAT=kv_format,
        HAS_WINDOW=sliding_window is not None, HAS_CAP=soft_cap is not None,
        SPLIT=split is not None,
    )
    if split is not None:
        _merge_splits_kernel[(num_tiles, Hq)](
            out, part_acc, part_ml, tile_q_starts, tile_first_ctx, split.tile_work_start,
            split.split_keys, out.stride(0), out.stride(1), HQ=Hq, D=D, D_PAD=d_pad)


def runs_here(device: torch.device) -> bool:
    """Whether the kernel can run on `device`: compiled on CUDA, interpreted on CPU."""
    from triton.runtime.interpreter import InterpretedFunction

    if isinstance(_paged_attention_kernel, InterpretedFunction):
        return device.type == "cpu"
    return device.type == "cuda"


def cache_args(k_cache: torch.Tensor, v_cache: torch.Tensor, kv_scales: torch.Tensor | None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """A layer's cache halves and fp8 scales as the attention and store kernels take them,
    with KV_FORMAT: an fp8 cache as its bytes (the kernels decode them), an empty scales
    tensor where none is read."""
    fmt = format_of_storage(k_cache.dtype)
    k_cache, v_cache = fmt.bytes_view(k_cache), fmt.bytes_view(v_cache)
    if fmt.kernel_id == FP8:
        assert kv_scales is not None, "an fp8 cache needs its scales"
    if kv_scales is None:
        kv_scales = torch.empty(0, dtype=torch.float32, device=k_cache.device)  # never read
    return k_cache, v_cache, kv_scales, fmt.kernel_id
