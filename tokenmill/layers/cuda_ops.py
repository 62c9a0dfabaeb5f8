"""The layers' one check for their CUDA fast path: the fused Triton ops (layers/triton_ops.py)
for a CUDA tensor, None otherwise (a CPU tensor, or no Triton installed: a CPU install need not
have it). Imported lazily, so that importing the layers never needs Triton."""

from __future__ import annotations

import functools
from types import ModuleType

import torch


@functools.cache
def _triton_ops() -> ModuleType | None:
    try:
        from tokenmill.layers import triton_ops
    except ImportError:
        return None
    return triton_ops


def cuda_ops(x: torch.Tensor) -> ModuleType | None:
    """layers/triton_ops.py when x may take it (a CUDA tensor, Triton installed), else None."""
    return _triton_ops() if x.is_cuda else None
