"""Prepacked oneDNN float32 GEMMs: the fast weight path on CPU.

On this class of CPU, `F.linear` (MKL sgemm on a row-major weight) reaches about 70-140
GFLOP/s on serving shapes (M = 1..512, K = 576..1536); oneDNN with the weight reordered once
into its blocked layout reaches 180-210, and 2-2.5x on batch-1 GEMV (benchmarks/RESULTS.md).
The result is float32 throughout (no reduced-precision math): only the summation order differs.

Invariant: a packed weight is an opaque mkldnn tensor; it is only ever passed to
`packed_linear`. Packing happens once, after loading (`prepack_model`), and frees the dense copy
unless the tensor is shared (a tied LM head keeps the embedding table).
"""

from __future__ import annotations

import torch
from torch import nn

# oneDNN picks its blocking for this many rows; measured within noise of the best for
# M = 16..2048 and about as good as any hint for M = 1.
_BATCH_HINT = 64


def onednn_available(device: torch.device, dtype: torch.dtype) -> bool:
    return (device.type == "cpu" and dtype == torch.float32
            and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
            and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


def prepack(weight: torch.Tensor) -> torch.Tensor:
    """(N, K) dense float32 → opaque oneDNN weight for `packed_linear`."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), _BATCH_HINT)


def packed_linear(x: torch.Tensor, packed: torch.Tensor,
                  bias: torch.Tensor | None = None) -> torch.Tensor:
    """x (..., K) @ W^T + bias → (..., N), W prepacked by `prepack`."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def prepack_model(model: nn.Module) -> int:
    """Prepack every layer that supports it (a `prepack()` method); returns how many."""
    count = 0
    for module in model.modules():
        fn = getattr(module, "prepack", None)
        if callable(fn):
            fn()
            count += 1
    return count
