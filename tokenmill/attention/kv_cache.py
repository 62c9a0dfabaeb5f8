"""The KV cache tensor: layout, sizing from a memory budget, and writes by slot mapping.

Layout: one tensor (num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim); layer i's
cache is `cache[i]`, K at [0] and V at [1]. Slot s is block s // block_size, offset
s % block_size, so a flat view (num_blocks * block_size, Hkv, D) is indexed by slot directly.
Zero-initialised: attention masks stale slots, and 0 * garbage must never make a NaN.
"""

from __future__ import annotations

import torch

from tokenmill.layers import cpu_ops
from tokenmill.utils import huge_pages


def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int,
                    dtype: torch.dtype) -> int:
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * num_layers * block_size * num_kv_heads * head_dim * elem


def allocate_kv_cache(num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                      head_dim: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    shape = (num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim)
    if device.type == "cpu":
        # Fresh anonymous memory: the OS hands out zero pages as they are first touched,
        # instead of writing gigabytes of zeros up front (about 0.9 s of start-up for 2 GiB),
        # in 2 MiB huge pages where it can (fewer faults and TLB misses over scattered blocks).
        return huge_pages.zeros(shape, dtype)
    return torch.zeros(shape, dtype=dtype, device=device)


def store_kv(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Write k, v (T, Hkv, D) of this step into one layer's cache (2, nb, bs, Hkv, D)."""
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
