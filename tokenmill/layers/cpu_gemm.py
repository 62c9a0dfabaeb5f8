"""Prepacked oneDNN float32 GEMMs: the fast weight path on CPU.

On this class of CPU, `F.linear` (MKL sgemm on a row-major weight) reaches about 70-140
GFLOP/s on serving shapes (M = 1..512, K = 576..1536); oneDNN with the weight reordered once
into its blocked layout reaches 180-210, and 2-2.5x on batch-1 GEMV (benchmarks/RESULTS.md).
The result is float32 throughout (no reduced-precision math): only the summation order differs.

Invariant: a packed weight is an opaque mkldnn tensor; it is only ever passed to
`packed_linear`. The unquantized method (quantization/unquantized.py) packs once, after
loading, and decides whether the dense copy stays.
"""

from __future__ import annotations

import torch

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
