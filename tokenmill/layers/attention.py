"""Attention layer: the model-side handle on one layer's KV cache and the attention backend.

The model runner binds each layer's cache slice and the backend once, after allocating the
cache (`bind`); per step everything else arrives in the explicit AttentionMetadata.
"""

from __future__ import annotations

import torch
from torch import nn

from tokenmill.attention import AttentionBackend, AttentionMetadata
from tokenmill.utils.profiling import scope


class Attention(nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = scale
        self.kv_cache: torch.Tensor | None = None  # (2, num_blocks, block_size, Hkv, R)
        self.kv_scales: torch.Tensor | None = None  # (2, Hkv): an fp8 cache's scales
        self.key_rotation: torch.Tensor | None = None  # (D, D): a quantized cache's
        self.backend: AttentionBackend | None = None

    def bind(self, kv_cache: torch.Tensor, backend: AttentionBackend,
             kv_scales: torch.Tensor | None = None,
             key_rotation: torch.Tensor | None = None) -> None:
        """kv_scales, key_rotation: a quantized cache's (attention/kv_cache.py)."""
        self.kv_cache, self.backend, self.kv_scales = kv_cache, backend, kv_scales
        self.key_rotation = key_rotation

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        """q (T, Hq, D); k, v (T, Hkv, D) → (T, Hq * D)."""
        if self.backend is None or self.kv_cache is None:
            raise RuntimeError("attention layer used before its KV cache was bound")
        with scope("attention"):
            if self.key_rotation is not None:  # q . k = (q R) . (k R): keys stored rotated
                q, k = q @ self.key_rotation, k @ self.key_rotation
            return self.backend.forward(q, k, v, self.kv_cache, meta, self.scale, self.kv_scales)
