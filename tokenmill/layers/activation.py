"""Gated activations for gated MLPs: x = [gate | up] (…, 2I) → act(gate) * up (…, I).
SiLU (Llama, Qwen, Mixtral: one C++ pass on CPU float32, layers/cpu_ops.py) and GELU, exact or
tanh-approximated (Gemma's gelu_pytorch_tanh); `gated_activation` maps a config's name to one
and refuses the names it does not know."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.layers import cpu_ops


class SiluAndMul(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if cpu_ops.fused(x):
            return cpu_ops.silu_and_mul(x)
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up


class GeluAndMul(nn.Module):
    def __init__(self, approximate: str = "none") -> None:
        super().__init__()
        self.approximate = approximate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.gelu(gate, approximate=self.approximate) * up


# transformers' ACT2FN names → the gated activation computing act(gate) * up
_GATED = {"silu": SiluAndMul, "swish": SiluAndMul,
          "gelu_pytorch_tanh": lambda: GeluAndMul("tanh"), "gelu": GeluAndMul}


def gated_activation(config: Any) -> nn.Module:
    """The MLP activation the config names (`hidden_activation`, Gemma's, or `hidden_act`);
    ValueError for one not implemented, never a silent substitute."""
    name = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", "silu")
    if name not in _GATED:
        raise ValueError(f"unsupported MLP activation {name!r}; supported: {', '.join(_GATED)}")
    return _GATED[name]()
