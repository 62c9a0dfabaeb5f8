"""RMSNorm as Hugging Face computes it (variance in float32, weight applied after the cast back;
float32 input takes torch's fused kernel), with an optional fused residual add:
`norm(x, residual)` returns (normed, x + residual); on CPU float32 that is one C++ pass
(layers/cpu_ops.py), on CUDA one Triton launch (layers/triton_ops.py, the same roundings)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.layers import cpu_ops
from tokenmill.layers.cuda_ops import cuda_ops
from tokenmill.layers.op_spec import OpSpec


class RMSNorm(nn.Module):
    computes = ("forward", "_norm")

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(hidden_size), requires_grad=False)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:  # one fused kernel; the same math as below
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        gpu = cuda_ops(x)
        if gpu is not None:  # one launch
            return cuda_rms_norm(gpu, x, self.weight, self.eps, residual)
        if residual is None:
            return self._norm(x)
        if cpu_ops.fused(x):
            return cpu_ops.add_rms_norm(x, residual, self.weight, self.eps)
        x = x + residual
        return self._norm(x), x

    def op_spec(self) -> OpSpec:
        return OpSpec("rms_norm", params={"weight": self.weight, "eps": self.eps})


def cuda_rms_norm(gpu: Any, x: torch.Tensor, weight: torch.Tensor, eps: float,
                  residual: torch.Tensor | None, unit_offset: bool = False
                  ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """layers/triton_ops.py's rms_norm over x's rows (any leading shape)."""
    shape = x.shape
    rows = x.reshape(-1, shape[-1])
    if residual is None:
        return gpu.rms_norm(rows, weight, eps, unit_offset=unit_offset).view(shape)
    out, total = gpu.rms_norm(rows, weight, eps, residual.reshape(-1, shape[-1]), unit_offset)
    return out.view(shape), total.view(shape)
