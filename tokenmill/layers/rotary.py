"""Rotary position embedding with a precomputed cos/sin table indexed by position.

Inverse frequencies come from transformers' own RoPE initialisers (default, linear, llama3,
yarn, longrope), so scaled variants match Hugging Face exactly; the table is (max_positions,
rotary_dim) in the non-interleaved "rotate_half" convention of HF Llama. `rotary_dim` is the
head's first `partial_rotary_factor` share (Phi-4-mini and others rotate part of each head);
the rest passes through.

A model may have several RoPE variants: Gemma 3's sliding-window layers use another base than
its global ones, its config's `rope_parameters` keyed by layer type. `rope_key(config, i)`
names layer i's variant ("default" when the config has one), and the model keeps one table per
variant. longrope (Phi-3): positions below `original_max_position_embeddings` take the short
factors, positions from there on the long ones; transformers recomputes the frequencies per
forward call from its longest position, which is the same thing for every token decoded
one at a time and for every prompt shorter than that length.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from tokenmill.layers import cpu_ops
from tokenmill.layers.cuda_ops import cuda_ops
from tokenmill.layers.op_spec import OpSpec


def rope_parameter_sets(hf_config: Any) -> dict[str, dict[str, Any]]:
    """RoPE variant name → its parameters: {"default": rope_parameters}, or one entry per layer
    type where the config keys them so (Gemma 3)."""
    rope = getattr(hf_config, "rope_parameters", None) or {}
    types = set(getattr(hf_config, "layer_types", None) or [])
    if types and types <= set(rope):
        return {t: rope[t] or {} for t in types}
    return {"default": rope}


def rope_key(hf_config: Any, layer_idx: int) -> str:
    """The RoPE variant layer `layer_idx` uses."""
    sets = rope_parameter_sets(hf_config)
    return "default" if "default" in sets else hf_config.layer_types[layer_idx]


def _inv_freq(hf_config: Any, head_dim: int, key: str, seq_len: int | None = None
              ) -> tuple[torch.Tensor, float]:
    rope = rope_parameter_sets(hf_config)[key]
    rope_type = rope.get("rope_type", "default")
    if rope_type == "default":
        base = float(rope.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0)))
        dim = rotary_dim(hf_config, head_dim)
        exps = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
        return 1.0 / (base ** exps), 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    kwargs = {} if key == "default" else {"layer_type": key}
    if seq_len is not None:
        kwargs["seq_len"] = seq_len
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](hf_config, torch.device("cpu"), **kwargs)
    return inv_freq.float(), float(scaling)


def rotary_dim(hf_config: Any, head_dim: int) -> int:
    """How many leading features of each head are rotated."""
    rope = getattr(hf_config, "rope_parameters", None) or {}
    factor = rope.get("partial_rotary_factor", getattr(hf_config, "partial_rotary_factor", 1.0))
    return int(head_dim * (factor or 1.0))


def _table(inv_freq: torch.Tensor, scaling: float, positions: torch.Tensor
           ) -> tuple[torch.Tensor, torch.Tensor]:
    freqs = torch.outer(positions, inv_freq)  # (P, R/2)
    emb = torch.cat([freqs, freqs], dim=-1)  # (P, R)
    return emb.cos() * scaling, emb.sin() * scaling


class RotaryEmbedding(nn.Module):
    computes = ("forward",)

    def __init__(self, head_dim: int, max_positions: int, hf_config: Any,
                 key: str = "default") -> None:
        super().__init__()
        self.head_dim, self.rotary_dim = head_dim, rotary_dim(hf_config, head_dim)
        device = torch.get_default_device()  # the model's (built under torch.device(...))
        # The table is computed on the CPU whatever that device (transformers' initialisers
        # make CPU tensors; one device's arithmetic for every engine), then moved there.
        with torch.device("cpu"):
            pos = torch.arange(max_positions, dtype=torch.float32)
            cos, sin = _table(*_inv_freq(hf_config, head_dim, key), pos)
            rope = rope_parameter_sets(hf_config)[key]
            if rope.get("rope_type") == "longrope":  # from the original length on: long factors
                start = int(rope["original_max_position_embeddings"])
                long_cos, long_sin = _table(*_inv_freq(hf_config, head_dim, key, start + 1),
                                            pos)
                cos[start:], sin[start:] = long_cos[start:], long_sin[start:]
        self.register_buffer("cos", cos.to(device), persistent=False)
        self.register_buffer("sin", sin.to(device), persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """positions (T,) → cos, sin (T, 1, R): computed once per step by the model and shared
        by every layer (as Hugging Face's `position_embeddings`)."""
        cos = self.cos[positions].unsqueeze(1).to(dtype)  # (T, 1, R)
        sin = self.sin[positions].unsqueeze(1).to(dtype)
        return cos, sin

    def op_spec(self) -> OpSpec:
        """rotate_half RoPE from this table, over whole heads or their first rotary_dim
        features ("partial")."""
        partial = self.rotary_dim < self.head_dim
        return OpSpec("rope", frozenset({"partial"} if partial else ()), params={"table": self})


def apply_rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """q (T, Hq, D), k (T, Hkv, D), cos / sin (T, 1, R) → rotated q, k (the first R features
    of each head rotated, the rest as they were: partial rotary when R < D).

    On CPU float32 and on CUDA, q and k (views of the fused qkv output) are rotated in place
    (layers/cpu_ops.py, layers/triton_ops.py: the same roundings as the PyTorch code below)."""
    R = cos.shape[-1]
    gpu = cuda_ops(q)
    if gpu is not None and q.stride(-1) == 1 and k.stride(-1) == 1 and cos.stride(-1) == 1:
        gpu.rotary_(q, k, cos, sin)  # partial rotary too: features past R left as they are
        return q, k
    if q.shape[-1] > R:
        q_rot, k_rot = apply_rotary(q[..., :R].contiguous(), k[..., :R].contiguous(), cos, sin)
        return torch.cat([q_rot, q[..., R:]], -1), torch.cat([k_rot, k[..., R:]], -1)
    if cpu_ops.fused(q) and q.stride(-1) == 1 and k.stride(-1) == 1:
        cpu_ops.rotary_(q, k, cos, sin)
        return q, k
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)
