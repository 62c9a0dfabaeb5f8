"""Gated activations for gated MLPs: x = [gate | up] (…, 2I) → act(gate) * up (…, I).
SiLU (Llama, Qwen, Mixtral) and GELU, exact or tanh-approximated (Gemma's gelu_pytorch_tanh):
one C++ pass each on CPU float32 (layers/cpu_ops.py `gated_act`, which the fused decode call
runs too), one Triton launch on CUDA (layers/triton_ops.py, the same roundings), PyTorch's ops
elsewhere; `gated_activation` maps a config's name to one and
refuses the names it does not know. Each states its op for the fused call (layers/op_spec.py)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.layers import cpu_ops
from tokenmill.layers.cuda_ops import cuda_ops
from tokenmill.layers.op_spec import OpSpec


class SiluAndMul(nn.Module):
    computes = ("forward",)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (gpu := cuda_ops(x)) is not None:
            return _on_rows(gpu.gated_act, x, "silu")
        if cpu_ops.fused(x):
            return cpu_ops.gated_act(x, "silu")
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up

    def op_spec(self) -> OpSpec:
        return OpSpec("gated_act", frozenset({"silu"}))


class GeluAndMul(nn.Module):
    computes = ("forward",)

    def __init__(self, approximate: str = "none") -> None:
        super().__init__()
        if approximate not in ("none", "tanh"):
            raise ValueError(f"GELU approximation {approximate!r}: 'none' or 'tanh'")
        self.approximate = approximate
        self.act = "gelu" if approximate == "none" else "gelu_tanh"  # cpu_ops' name

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (gpu := cuda_ops(x)) is not None:
            return _on_rows(gpu.gated_act, x, self.act)
        if cpu_ops.fused(x):
            return cpu_ops.gated_act(x, self.act)
        gate, up = x.chunk(2, dim=-1)
        return F.gelu(gate, approximate=self.approximate) * up

    def op_spec(self) -> OpSpec:
        return OpSpec("gated_act", frozenset({self.act}))


def _on_rows(op: Any, x: torch.Tensor, act: str) -> torch.Tensor:
    """op over x's rows (…, 2I) → (…, I)."""
    out = op(x.reshape(-1, x.shape[-1]), act)
    return out.view(*x.shape[:-1], out.shape[-1])


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
