"""SiLU-and-multiply for gated MLPs: x = [gate | up] (…, 2I) → silu(gate) * up (…, I);
one C++ pass on CPU float32 (layers/cpu_ops.py)."""

from __future__ import annotations

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
