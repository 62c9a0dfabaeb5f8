"""Attention layer: the model-side handle on one layer's KV cache and the attention backend.

The model runner binds each layer's cache slice and the backend once, after allocating the
cache (`bind`); per step everything else arrives in the explicit AttentionMetadata.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from tokenmill.attention import AttentionBackend, AttentionMetadata
from tokenmill.attention.base import AttentionVariant
from tokenmill.layers import cpu_ops
from tokenmill.layers.rotary import apply_rotary
from tokenmill.quantization.base import CPULinearKernel
from tokenmill.utils.profiling import scope


class Attention(nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                 sliding_window: int | None = None, soft_cap: float | None = None) -> None:
        """sliding_window: a query at position p attends keys at positions > p - window (as
        transformers' sliding-window mask); soft_cap: scores become cap * tanh(score / cap)
        before the softmax (Gemma 2). Both None: plain causal attention."""
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        # what the backend computes for this layer, fixed here (attention/base.py)
        self.variant = AttentionVariant(scale, sliding_window, soft_cap)
        self.kv_cache: torch.Tensor | None = None  # (2, num_blocks, block_size, Hkv, R)
        self.kv_scales: torch.Tensor | None = None  # (2, Hkv): an fp8 cache's scales
        self.key_rotation: torch.Tensor | None = None  # (D, D): a quantized cache's
        # R^T as a weight of the C++ linear op (rows of x @ R in a fixed order at any T;
        # torch's matmul rounds small batches differently)
        self.rotation_weight: torch.Tensor | None = None
        self.backend: AttentionBackend | None = None

    def bind(self, kv_cache: torch.Tensor, backend: AttentionBackend,
             kv_scales: torch.Tensor | None = None,
             key_rotation: torch.Tensor | None = None) -> None:
        """kv_scales, key_rotation: a quantized cache's (attention/kv_cache.py)."""
        self.kv_cache, self.backend, self.kv_scales = kv_cache, backend, kv_scales
        self.key_rotation = key_rotation
        self.rotation_weight = None if key_rotation is None else key_rotation.t().contiguous()

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                meta: AttentionMetadata,
                rotary: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """q (T, Hq, D); k, v (T, Hkv, D) → (T, Hq * D). rotary: the step's RoPE tables cos,
        sin (T, 1, R) to apply to q and k first (layers/rotary.py's apply_rotary), inside the
        backend's KV store where it fuses them (the Triton backend), else here."""
        if self.backend is None or self.kv_cache is None:
            raise RuntimeError("attention layer used before its KV cache was bound")
        if rotary is not None:
            # keys stored rotated by R (a quantized cache) take RoPE before R: not fused
            if self.key_rotation is None and self.backend.fuses_rotary(q, k, *rotary):
                with scope("attention"):
                    return self.backend.forward_rotary(self, q, k, v, *rotary, self.kv_cache,
                                                       meta)
            q, k = apply_rotary(q, k, *rotary)
        with scope("attention"):
            if self.key_rotation is not None:  # q . k = (q R) . (k R): keys stored rotated
                q, k = self._rotate(q), self._rotate(k)
            return self.backend.forward(self, q, k, v, self.kv_cache, meta)

    @property
    def scale(self) -> float:
        return self.variant.scale

    @property
    def sliding_window(self) -> int | None:
        return self.variant.sliding_window

    @property
    def soft_cap(self) -> float | None:
        return self.variant.soft_cap


    def _rotate(self, x: torch.Tensor) -> torch.Tensor:
        """x (T, H, D) @ R."""
        if not cpu_ops.fused(x):
            return x @ self.key_rotation
        T, H, D = x.shape
        kernel = CPULinearKernel(CPULinearKernel.DENSE, 0, (self.rotation_weight,))
        return cpu_ops.linear(x.reshape(T * H, D), kernel).view(T, H, D)


def attention_features(layers: Iterable[Attention]) -> frozenset[str]:
    """The attention variants (attention/base.py's FEATURES) some of `layers` use."""
    features = set()
    for a in layers:
        if a.sliding_window is not None:
            features.add("sliding_window")
        if a.soft_cap is not None:
            features.add("soft_cap")
    return frozenset(features)
