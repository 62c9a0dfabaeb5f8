"""The KV cache tensor: layout, sizing from a memory budget, and writes by slot mapping.

Layout: one tensor (num_layers, 2, num_blocks, block_size, num_kv_heads, R); layer i's cache
is `cache[i]`, K at [0] and V at [1]. Slot s is block s // block_size, offset s % block_size,
so a flat view (num_blocks * block_size, Hkv, R) is indexed by slot directly. A row (one
token, one KV head) is, by `kv_cache_dtype` (vLLM's option):
- "auto": head_dim values in the model's dtype (R = head_dim);
- "int8": head_dim int8 values, then their float32 scale as 4 bytes (R = head_dim + 4, int8
  storage): symmetric, one scale per token and KV head, x = q * scale, scale = max|x| / 127.
  The scale sits beside its values, so a block is self-contained: copy-on-write, swap and
  prefix-cache reuse move raw blocks and never need to know the format, and a block is only
  ever read in the format the tensor has.
Zero-initialised: attention masks stale slots, and 0 * garbage must never make a NaN (an
all-zero int8 row is 0 * scale 0.0).
"""

from __future__ import annotations

import torch

from tokenmill.layers import cpu_ops
from tokenmill.utils import huge_pages

KV_CACHE_DTYPES = ("auto", "int8")  # built
PLANNED_KV_CACHE_DTYPES = ("fp8",)  # vLLM's names not built yet: refused as such
_SCALE_BYTES = 4  # an int8 row's float32 scale


def row_format(head_dim: int, dtype: torch.dtype, kv_cache_dtype: str = "auto"
               ) -> tuple[int, torch.dtype]:
    """(R, storage dtype) of one cache row (see the module doc)."""
    if kv_cache_dtype == "int8":
        return head_dim + _SCALE_BYTES, torch.int8
    if kv_cache_dtype != "auto":
        raise ValueError(f"kv_cache_dtype {kv_cache_dtype!r} has no cache layout")
    return head_dim, dtype


def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int,
                    dtype: torch.dtype, kv_cache_dtype: str = "auto") -> int:
    """The real bytes of one block, all layers, K and V (values and scales)."""
    row, storage = row_format(head_dim, dtype, kv_cache_dtype)
    elem = torch.empty((), dtype=storage).element_size()
    return 2 * num_layers * block_size * num_kv_heads * row * elem


def allocate_kv_cache(num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                      head_dim: int, dtype: torch.dtype, device: torch.device,
                      kv_cache_dtype: str = "auto") -> torch.Tensor:
    row, dtype = row_format(head_dim, dtype, kv_cache_dtype)
    shape = (num_layers, 2, num_blocks, block_size, num_kv_heads, row)
    if device.type == "cpu":
        # Fresh anonymous memory: the OS hands out zero pages as they are first touched,
        # instead of writing gigabytes of zeros up front (about 0.9 s of start-up for 2 GiB),
        # in 2 MiB huge pages where it can (fewer faults and TLB misses over scattered blocks).
        return huge_pages.zeros(shape, dtype)
    return torch.zeros(shape, dtype=dtype, device=device)


def quantize_rows(x: torch.Tensor) -> torch.Tensor:
    """(…, D) float → (…, D + 4) int8 cache rows: values, then their float32 scale's bytes."""
    scale = x.float().abs().amax(dim=-1, keepdim=True) / 127.0  # (…, 1)
    q = (x.float() / scale.clamp(min=torch.finfo(torch.float32).tiny)).round_().clamp_(
        -127, 127).to(torch.int8)
    return torch.cat([q, scale.contiguous().view(torch.int8)], dim=-1)


def dequantize_rows(rows: torch.Tensor) -> torch.Tensor:
    """(…, D + 4) int8 cache rows → (…, D) float32."""
    scale = rows[..., -_SCALE_BYTES:].contiguous().view(torch.float32)  # (…, 1)
    return rows[..., :-_SCALE_BYTES].float() * scale


def on_grid(x: torch.Tensor) -> torch.Tensor:
    """(…, D) float rounded as an int8 cache stores it (what attention reads back)."""
    return dequantize_rows(quantize_rows(x)).to(x.dtype)


def as_float(rows: torch.Tensor) -> torch.Tensor:
    """Cache rows as values: dequantized when the cache is int8, else as they are."""
    return dequantize_rows(rows) if rows.dtype == torch.int8 else rows


def store_kv(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Write k, v (T, Hkv, D) of this step into one layer's cache (2, nb, bs, Hkv, R),
    quantized in the same pass when the cache is int8."""
    if kv_cache.dtype == torch.int8:
        flat = kv_cache.view(2, -1, *kv_cache.shape[-2:])  # (2, num_slots, Hkv, D + 4)
        flat[0].index_copy_(0, slot_mapping, quantize_rows(k))
        flat[1].index_copy_(0, slot_mapping, quantize_rows(v))
        return
    if (kv_cache.dtype == torch.float32 and cpu_ops.fused(k) and k.stride(1) == k.shape[2]
            and v.stride(1) == v.shape[2] and k.stride(2) == v.stride(2) == 1):
        cpu_ops.store_kv_(kv_cache[0], kv_cache[1], k, v, slot_mapping)  # one pass, one call
        return
    flat = kv_cache.view(2, -1, *kv_cache.shape[-2:])  # (2, num_slots, Hkv, D)
    flat[0].index_copy_(0, slot_mapping, k)
    flat[1].index_copy_(0, slot_mapping, v)


def copy_blocks(kv_cache: torch.Tensor, pairs: list[tuple[int, int]]) -> None:
    """Copy-on-write: copy whole blocks src -> dst in every layer."""
    if not pairs:
        return
    src = torch.tensor([p[0] for p in pairs], device=kv_cache.device)
    dst = torch.tensor([p[1] for p in pairs], device=kv_cache.device)
    kv_cache[:, :, dst] = kv_cache[:, :, src]
