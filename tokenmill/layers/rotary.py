"""Rotary position embedding with a precomputed cos/sin table indexed by position.

Inverse frequencies come from transformers' own RoPE initialisers (default, linear, llama3,
yarn), so scaled variants match Hugging Face exactly; the table is (max_positions, head_dim)
in the non-interleaved "rotate_half" convention of HF Llama.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from tokenmill.layers import cpu_ops


def _inv_freq(hf_config: Any, head_dim: int) -> tuple[torch.Tensor, float]:
    rope = getattr(hf_config, "rope_parameters", None) or {}
    rope_type = rope.get("rope_type", "default")
    if rope_type == "default":
        base = float(rope.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0)))
        exps = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
        return 1.0 / (base ** exps), 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](hf_config, torch.device("cpu"))
    return inv_freq.float(), float(scaling)


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_positions: int, hf_config: Any) -> None:
        super().__init__()
        inv_freq, scaling = _inv_freq(hf_config, head_dim)
        pos = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(pos, inv_freq)  # (P, D/2)
        emb = torch.cat([freqs, freqs], dim=-1)  # (P, D)
        self.register_buffer("cos", emb.cos() * scaling, persistent=False)
        self.register_buffer("sin", emb.sin() * scaling, persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """positions (T,) → cos, sin (T, 1, D): computed once per step by the model and shared
        by every layer (as Hugging Face's `position_embeddings`)."""
        cos = self.cos[positions].unsqueeze(1).to(dtype)  # (T, 1, D)
        sin = self.sin[positions].unsqueeze(1).to(dtype)
        return cos, sin


def apply_rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """q (T, Hq, D), k (T, Hkv, D), cos / sin (T, 1, D) → rotated q, k.

    On CPU float32 q and k (views of the fused qkv output) are rotated in place."""
    if cpu_ops.fused(q) and q.stride(-1) == 1 and k.stride(-1) == 1:
        cpu_ops.rotary_(q, k, cos, sin)
        return q, k
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)
