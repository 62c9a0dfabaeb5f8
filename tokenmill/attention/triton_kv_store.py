"""The Triton backend's KV-cache store: a step's k and v rows written into their cache slots,
quantized as they are written (`store_kv`), and the same store with the layer's RoPE applied
on the way (`rotary_store_kv`): q rotated in place and k rotated before it is stored, one
launch where RoPE and the store took two (issue 39's "RoPE + KV-cache store").

Rows are written in the cache's format (attention/kv_formats.py): the model's dtype, bfloat16
or float16 rows, int8 rows with their float32 scale after them, or fp8 e4m3 bytes under the
KV head's fixed scale, bit for bit as kv_cache.py's torch ops write them (the same divisions,
round-half-even, e4m3 encoding). The rotation rounds as layers/rotary.py's torch code: each
product rounded to the head's dtype, their sum rounded again (so the kernels are compiled
without fused multiply-adds, which would round once).

Invariants: k, v (T, Hkv, D) and q (T, Hq, D) have unit stride in D (views of the fused qkv
output are fine); the layer's cache (2, num_blocks, block_size, Hkv, R) is contiguous; a
token's slot is written by one program per KV head, and nothing else is written: k itself is
left unrotated by `rotary_store_kv`, because the attention kernel reads keys only from the
cache.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenmill.attention.triton_kernels import cache_args

# 1.5 * 2^23: x + it - it rounds float32 |x| < 2^22 half-to-even. A constexpr: compiled
# Triton reads no other module globals (the interpreter does, so only the GPU showed it).
_RNE_MAGIC = tl.constexpr(12582912.0)


@triton.jit
def _store_row(x, cache_ptr, slot, head_scale, h, d, d_ok, HKV: tl.constexpr,
               D: tl.constexpr, ROW: tl.constexpr, KV_FORMAT: tl.constexpr):
    """One (token, KV head) row x (D_PAD,) of k or v into its cache slot, in the cache's
    format."""
    row_ptr = cache_ptr + (slot * HKV + h) * ROW
    if KV_FORMAT == 0:  # the cache holds k's own dtype
        tl.store(row_ptr + d, x.to(cache_ptr.dtype.element_ty), mask=d_ok)
    elif KV_FORMAT == 1:  # int8 values, then their float32 scale
        x = x.to(tl.float32)
        scale = tl.math.div_rn(tl.max(tl.abs(x), axis=0), 127.0)
        q = tl.math.div_rn(x, tl.maximum(scale, 1.1754943508222875e-38))
        q = (q + _RNE_MAGIC) - _RNE_MAGIC
        q = tl.minimum(tl.maximum(q, -127.0), 127.0)
        tl.store(row_ptr + d, q.to(tl.int8), mask=d_ok)
        tl.store((row_ptr + D).to(tl.pointer_type(tl.float32)), scale)
    elif KV_FORMAT == 3:  # bfloat16, rounded half-to-even in integers as torch rounds (the
        # interpreter's float cast truncates); NaN stays NaN
        bits = x.to(tl.float32).to(tl.int32, bitcast=True)
        r = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        r = tl.where(x != x, 0x7FC0, r)
        tl.store(row_ptr + d, r.to(tl.int16).to(tl.bfloat16, bitcast=True), mask=d_ok)
    else:  # fp8 e4m3fn bytes (the cache read as uint8), saturating at 448
        v = tl.math.div_rn(x.to(tl.float32), head_scale)
        a = tl.minimum(tl.abs(v), 448.0)
        bits = a.to(tl.int32, bitcast=True)
        # normal (a >= 2^-6): round the mantissa to 3 bits half-to-even, rebias 127 -> 7
        normal = (bits + 0x7FFFF + ((bits >> 20) & 1)) >> 20
        normal = normal - ((127 - 7) << 3)
        # subnormal: a multiple of 2^-9, rounded half-to-even (8 is the smallest normal)
        sub = ((a * 512.0 + _RNE_MAGIC) - _RNE_MAGIC).to(tl.int32)
        code = tl.where(a >= 0.015625, normal, sub)
        code = code | ((v.to(tl.int32, bitcast=True) >> 24) & 0x80)  # the sign bit
        tl.store(row_ptr + d, code.to(tl.uint8), mask=d_ok)


@triton.jit
def _head_scales(kv_scales_ptr, h, HKV: tl.constexpr, KV_FORMAT: tl.constexpr):
    """(k scale, v scale) of KV head h: an fp8 cache's fixed scales, else 1 (unread)."""
    k_scale = 1.0
    v_scale = 1.0
    if KV_FORMAT == 2:
        k_scale = tl.load(kv_scales_ptr + h)
        v_scale = tl.load(kv_scales_ptr + HKV + h)
    return k_scale, v_scale


@triton.jit
def _store_kv_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, kv_scales_ptr,
                     stride_kt, stride_kh, stride_vt, stride_vh,
                     HKV: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
                     ROW: tl.constexpr, KV_FORMAT: tl.constexpr):
    t = tl.program_id(0)
    h = tl.program_id(1)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    d = tl.arange(0, D_PAD)
    d_ok = d < D
    k_scale, v_scale = _head_scales(kv_scales_ptr, h, HKV, KV_FORMAT)
    k = tl.load(k_ptr + t * stride_kt + h * stride_kh + d, mask=d_ok, other=0.0)
    _store_row(k, k_cache_ptr, slot, k_scale, h, d, d_ok, HKV, D, ROW, KV_FORMAT)
    v = tl.load(v_ptr + t * stride_vt + h * stride_vh + d, mask=d_ok, other=0.0)
    _store_row(v, v_cache_ptr, slot, v_scale, h, d, d_ok, HKV, D, ROW, KV_FORMAT)


def store_kv(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor, kv_scales: torch.Tensor | None = None) -> None:
    """k, v (T, Hkv, D) into one layer's cache (2, num_blocks, block_size, Hkv, R) at
    slot_mapping (T,), quantized in the same kernel when the cache rounds what it holds (one
    program per token and KV head)."""
    T, Hkv, D = k.shape
    if T == 0:
        return
    assert k.stride(2) == 1 and v.stride(2) == 1 and kv_cache.is_contiguous()
    k_cache, v_cache, kv_scales, kv_format = cache_args(kv_cache[0], kv_cache[1], kv_scales)
    _store_kv_kernel[(T, Hkv)](
        k, v, k_cache, v_cache, slot_mapping, kv_scales,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        HKV=Hkv, D=D, D_PAD=triton.next_power_of_2(D), ROW=kv_cache.shape[-1],
        KV_FORMAT=kv_format)


@triton.jit
def _rotated_head(ptr, cos_row, sin_row, d, d_ok, HALF: tl.constexpr):
    """One head's values (D_PAD,) at ptr with their first 2 HALF features rotated
    (rotate_half: x * cos + rotate_half(x) * sin, each product rounded to the head's dtype
    before the sum), the rest as they are."""
    x = tl.load(ptr + d, mask=d_ok, other=0.0)
    rot = d < 2 * HALF
    first = d < HALF
    partner = tl.load(ptr + tl.where(first, d + HALF, d - HALF), mask=rot, other=0.0)
    c = tl.load(cos_row + d, mask=rot, other=0.0).to(tl.float32)
    s = tl.load(sin_row + d, mask=rot, other=0.0).to(tl.float32)
    a = x.to(tl.float32)
    p = tl.where(first, -partner.to(tl.float32), partner.to(tl.float32))
    dt = x.dtype
    y = ((a * c).to(dt).to(tl.float32) + (p * s).to(dt).to(tl.float32)).to(dt)
    return tl.where(rot, y, x)


@triton.jit
def _rotary_store_kv_kernel(q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, k_cache_ptr, v_cache_ptr,
                            slot_ptr, kv_scales_ptr, stride_qt, stride_qh, stride_kt,
                            stride_kh, stride_vt, stride_vh, stride_ct,
                            HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr,
                            D_PAD: tl.constexpr, HALF: tl.constexpr, ROW: tl.constexpr,
                            KV_FORMAT: tl.constexpr):
    """Program (t, h): q head h rotated in place (h < HQ), or KV head h - HQ: k rotated and
    stored, v stored."""
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    d = tl.arange(0, D_PAD)
    d_ok = d < D
    cos_row = cos_ptr + t * stride_ct
    sin_row = sin_ptr + t * stride_ct
    if h < HQ:
        ptr = q_ptr + t * stride_qt + h * stride_qh
        tl.store(ptr + d, _rotated_head(ptr, cos_row, sin_row, d, d_ok, HALF), mask=d_ok)
    else:
        h = h - HQ
        slot = tl.load(slot_ptr + t).to(tl.int64)
        k_scale, v_scale = _head_scales(kv_scales_ptr, h, HKV, KV_FORMAT)
        k = _rotated_head(k_ptr + t * stride_kt + h * stride_kh, cos_row, sin_row, d, d_ok,
                          HALF)
        _store_row(k, k_cache_ptr, slot, k_scale, h, d, d_ok, HKV, D, ROW, KV_FORMAT)
        v = tl.load(v_ptr + t * stride_vt + h * stride_vh + d, mask=d_ok, other=0.0)
        _store_row(v, v_cache_ptr, slot, v_scale, h, d, d_ok, HKV, D, ROW, KV_FORMAT)


def rotary_fits(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                ) -> bool:
    """Whether rotary_store_kv takes these operands: unit stride in each head's features, and
    one layout for the cos and sin tables."""
    return (q.stride(-1) == 1 and k.stride(-1) == 1 and cos.stride(-1) == 1
            and cos.stride() == sin.stride() and cos.shape[-1] % 2 == 0)


def rotary_store_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
                    sin: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
                    kv_scales: torch.Tensor | None = None) -> None:
    """RoPE by cos / sin (T, 1, R) over the first R features of every head of q (T, Hq, D),
    in place, and of k (T, Hkv, D) on its way into the cache; v (T, Hkv, D) stored beside it:
    what layers/rotary.py's rotary_ followed by store_kv write, in one launch."""
    T, Hq, D = q.shape
    Hkv = k.shape[1]
    if T == 0:
        return
    assert rotary_fits(q, k, cos, sin) and v.stride(2) == 1 and kv_cache.is_contiguous()
    k_cache, v_cache, kv_scales, kv_format = cache_args(kv_cache[0], kv_cache[1], kv_scales)
    # enable_fp_fusion=False: the GPU compiler would otherwise fuse a product into the sum
    # (one rounding, where torch's ops and the interpreter round twice)
    _rotary_store_kv_kernel[(T, Hq + Hkv)](
        q, k, v, cos, sin, k_cache, v_cache, slot_mapping, kv_scales,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        cos.stride(0), HQ=Hq, HKV=Hkv, D=D, D_PAD=triton.next_power_of_2(D),
        HALF=cos.shape[-1] // 2, ROW=kv_cache.shape[-1], KV_FORMAT=kv_format,
        enable_fp_fusion=False)
