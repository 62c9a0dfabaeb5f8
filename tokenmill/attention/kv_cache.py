"""The KV cache tensor: layout, sizing from a memory budget, and writes by slot mapping.

Layout: one tensor (num_layers, 2, num_blocks, block_size, num_kv_heads, R); layer i's cache
is `cache[i]`, K at [0] and V at [1]. Slot s is block s // block_size, offset s % block_size,
so a flat view (num_blocks * block_size, Hkv, R) is indexed by slot directly. A row (one
token, one KV head) is in the format `kv_cache_dtype` (vLLM's option) names, one registered
object each (attention/kv_formats.py): "auto" (the model's dtype), "bfloat16" (a float32
model's values rounded to bfloat16), "int8" (values and their per-row scale), "fp8" (=
"fp8_e4m3": e4m3 values, x = fp8 * head_scale). Whatever a row needs
besides its bytes is fixed for the cache's life, so a block is self-contained: copy-on-write,
swap and prefix-cache reuse move raw blocks and never need to know the format.
fp8's scales, K's and V's per KV head of each layer (`kv_scales`, (num_layers, 2, Hkv)
float32), are 1.0 (vLLM's default when a checkpoint carries none): e4m3's relative step
(1/16) does not depend on the scale, which only has to keep values inside its range (|x| <=
448; over ~1,500 tokens of prose SmolLM2's largest |K| is 22.5 and |V| 14.5, and 1% of K, 3%
of V fall below e4m3's normal range (2^-6), where the step is 2^-9 absolute).
Keys in a quantized cache are stored rotated (`key_rotation`): k R for a fixed orthonormal
R (head_dim x head_dim, a normalised Hadamard matrix), and the attention layer rotates queries
by the same R, so q . k = (q R) . (k R) and attention is unchanged before rounding (QuaRot's
treatment of the KV cache). A rotation spreads SmolLM2's outlier key channels (|K| up to 22.5,
median 1.0) over the whole head, so the row's max, which sets int8's step, is no longer one
channel's: top-1 agreement with a float32 cache goes from 98.5% to 99.1% (int8) and from 95.8%
to 96.5% (fp8) on benchmarks/quant_quality.py's text. Keys carry nearly all the error (V alone
on the int8 grid: 99.7%), so values are stored as they are. R is fixed for the cache's life,
like fp8's scales: blocks stay self-contained.
Zero-initialised: attention masks stale slots, and 0 * garbage must never make a NaN (an
all-zero int8 row is 0 * scale 0.0).
"""

from __future__ import annotations

import torch

from tokenmill.attention.input_batch import tensor_on
from tokenmill.attention.kv_formats import KVFormat, format_of_storage, kv_format
from tokenmill.layers import cpu_ops
from tokenmill.utils import huge_pages


def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int,
                    dtype: torch.dtype, kv_cache_dtype: str = "auto") -> int:
    """The real bytes of one block, all layers, K and V (values and scales)."""
    row, storage = kv_format(kv_cache_dtype).row(head_dim, dtype)
    elem = torch.empty((), dtype=storage).element_size()
    return 2 * num_layers * block_size * num_kv_heads * row * elem


def allocate_kv_cache(num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                      head_dim: int, dtype: torch.dtype, device: torch.device,
                      kv_cache_dtype: str = "auto") -> torch.Tensor:
    row, dtype = kv_format(kv_cache_dtype).row(head_dim, dtype)
    shape = (num_layers, 2, num_blocks, block_size, num_kv_heads, row)
    if device.type == "cpu":
        # Fresh anonymous memory: the OS hands out zero pages as they are first touched,
        # instead of writing gigabytes of zeros up front (about 0.9 s of start-up for 2 GiB),
        # in 2 MiB huge pages where it can (fewer faults and TLB misses over scattered blocks).
        return huge_pages.zeros(shape, dtype)
    return torch.zeros(shape, dtype=dtype, device=device)


def key_rotation(head_dim: int, kv_cache_dtype: str, device: torch.device
                 ) -> torch.Tensor | None:
    """(D, D) float32 orthonormal R that a quantized cache's keys (and the queries) are rotated
    by (see the module doc); None for a float cache. A Sylvester Hadamard matrix / sqrt(D)
    when D is a power of two, else a fixed seeded random orthogonal matrix."""
    if not kv_format(kv_cache_dtype).quantized:
        return None
    if head_dim & (head_dim - 1) == 0:
        r = torch.ones(1, 1)
        while r.shape[0] < head_dim:
            r = torch.cat([torch.cat([r, r], 1), torch.cat([r, -r], 1)], 0)
        r = r / head_dim ** 0.5
    else:
        gen = torch.Generator().manual_seed(0)
        r = torch.linalg.qr(torch.randn(head_dim, head_dim, generator=gen,
                                        dtype=torch.float64))[0].float()
    return r.to(device)


def allocate_kv_scales(num_layers: int, num_kv_heads: int, device: torch.device,
                       kv_cache_dtype: str) -> torch.Tensor | None:
    """(num_layers, 2, Hkv) float32 scales of a format that has them (fp8's, all 1.0)."""
    return kv_format(kv_cache_dtype).head_scales(num_layers, num_kv_heads, device)


def on_grid(x: torch.Tensor, cache_dtype: torch.dtype = torch.int8,
            head_scales: torch.Tensor | None = None) -> torch.Tensor:
    """(…, Hkv, D) float rounded as a cache of storage `cache_dtype` stores it (what attention
    reads back): bfloat16, int8 rows, or fp8 with head_scales (Hkv,); x's own dtype holds
    x as it is."""
    fmt = format_of_storage(cache_dtype)
    scales = None if head_scales is None else head_scales.view(-1, 1)
    return fmt.dequantize(fmt.quantize(x, head_scales), scales).to(x.dtype)


def as_float(rows: torch.Tensor, kv_scales: torch.Tensor | None = None,
             dtype: torch.dtype | None = None) -> torch.Tensor:
    """K and V cache rows (2, …, Hkv, R) as values (2, …, Hkv, D): dequantized when the cache
    is quantized (kv_scales (2, Hkv): the layer's fp8 scales), else as they are; in `dtype`
    (the queries') where given."""
    scales = None if kv_scales is None else kv_scales.view(2, *[1] * (rows.dim() - 3), -1, 1)
    values = format_of_storage(rows.dtype).dequantize(rows, scales)
    return values if dtype is None else values.to(dtype)


def store_kv(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor, kv_scales: torch.Tensor | None = None) -> None:
    """Write k, v (T, Hkv, D) of this step into one layer's cache (2, nb, bs, Hkv, R),
    quantized in the same pass when the cache is int8 or fp8 (kv_scales (2, Hkv): the
    layer's fp8 scales). The C++ op does it in one call on CPU; torch ops elsewhere, with
    the same results bit for bit."""
    if (cpu_ops.fused(k) and k.stride(1) == k.shape[2] and v.stride(1) == v.shape[2]
            and k.stride(2) == v.stride(2) == 1):
        cpu_ops.store_kv_(kv_cache[0], kv_cache[1], k, v, slot_mapping, kv_scales)
        return
    fmt: KVFormat = format_of_storage(kv_cache.dtype)
    k_scales, v_scales = (None, None) if kv_scales is None else (kv_scales[0], kv_scales[1])
    flat = fmt.bytes_view(kv_cache.view(2, -1, *kv_cache.shape[-2:]))  # (2, num_slots, Hkv, R)
    # a float cache of another dtype than k's (bfloat16 under float32) takes k rounded to it
    k = fmt.bytes_view(fmt.quantize(k, k_scales)).to(flat.dtype)
    v = fmt.bytes_view(fmt.quantize(v, v_scales)).to(flat.dtype)
    flat[0].index_copy_(0, slot_mapping, k)
    flat[1].index_copy_(0, slot_mapping, v)


def swap_blocks(kv_cache: torch.Tensor, swap_cache: torch.Tensor | None,
                out: list[tuple[int, int]], back: list[tuple[int, int]]) -> None:
    """Swap-mode preemption's copies, before the forward pass (swapped-out blocks may be
    reused by this very step): `out` (cache, swap) pairs, then `back` (swap, cache)."""
    if out:
        gpu, cpu = zip(*out, strict=True)
        swap_cache[:, :, list(cpu)] = kv_cache[:, :, list(gpu)].to("cpu")
    if back:
        cpu, gpu = zip(*back, strict=True)
        kv_cache[:, :, list(gpu)] = swap_cache[:, :, list(cpu)].to(kv_cache.device)


def copy_blocks(kv_cache: torch.Tensor, pairs: list[tuple[int, int]]) -> None:
    """Copy-on-write: copy whole blocks src -> dst in every layer."""
    if not pairs:
        return
    src = tensor_on([p[0] for p in pairs], kv_cache.device)
    dst = tensor_on([p[1] for p in pairs], kv_cache.device)
    kv_cache[:, :, dst] = kv_cache[:, :, src]
