"""The method objects of block-quantized weights (Q8_0 and Q4 layouts, quantization/blocks.py):
what every quantized format becomes after loading, whatever its checkpoint held.

Subclasses differ only in what the checkpoint holds and how `process_weights_after_loading`
turns it into blocks (`set_blocks`); the kernel descriptor, `apply` (the C++ `linear`
op at every M) and row lookups are shared. The blocks are the layer's parameters `blocks_q`,
`blocks_d` and, for 4-bit, `blocks_m` (and `input_scale` where an activation-aware search
scaled the weight's input channels); no float copy of the weight is kept. On AVX-512 VNNI
builds they are packed into tiles of 16 rows as they are set (quantization/block_tiles.py:
kinds Q8_0_TILES and Q4_TILES, `blocks_q` 3-D), except in a table that is only looked up.
On CUDA the same blocks are multiplied by a Triton GEMM (quantization/triton_block_gemm.py)
and embedding rows are dequantized with PyTorch's ops (blocks.dequantize), in the dtype the
layer was built with.
"""

from __future__ import annotations

import torch
from torch import nn

from tokenmill.quantization import block_tiles
from tokenmill.quantization.base import CPULinearKernel, LinearMethodBase, replace_param
from tokenmill.quantization.blocks import dequantize


def on_cuda(x: torch.Tensor) -> bool:
    """Whether x takes the CUDA branch (the tests route CPU tensors into it, interpreted)."""
    return x.is_cuda


class BlockLinearMethod(LinearMethodBase):
    def __init__(self, kind: int, group: int, int8_activations: bool = False,
                 batch_invariant: bool = True) -> None:
        if kind not in (CPULinearKernel.Q8_0, CPULinearKernel.Q4):
            raise ValueError(f"not a block kind: {kind}")
        self.kind, self.group = kind, group
        # Every step multiplies int8-quantized activations (EngineConfig option).
        self.int8_activations = int8_activations
        self.batch_invariant = batch_invariant

    def set_blocks(self, layer: nn.Module, q: torch.Tensor, d: torch.Tensor,
                   m: torch.Tensor | None = None) -> None:
        kernel = CPULinearKernel(self.kind, getattr(layer, "group_size", self.group),
                                 (q, d) if m is None else (q, d, m))
        blocks = block_tiles.packed_for(layer, kernel).tensors
        names = ("blocks_q", "blocks_d", "blocks_m")
        for name, value in zip(names, (*blocks, None)[:3], strict=True):
            replace_param(layer, name, None if value is None else value.contiguous())

    def cpu_kernel(self, layer: nn.Module) -> CPULinearKernel | None:
        q = getattr(layer, "blocks_q", None)
        if q is None or not q.is_cpu:
            return None
        return self.blocks_kernel(layer)

    def blocks_kernel(self, layer: nn.Module) -> CPULinearKernel:
        """The layer's blocks as a kernel object, on whichever device they are."""
        names = ("blocks_q", "blocks_d") + (("blocks_m",) if self.kind == CPULinearKernel.Q4
                                             else ())
        group = getattr(layer, "group_size", self.group)  # set where it varies by layer
        return CPULinearKernel(block_tiles.held_kind(self.kind, layer.blocks_q), group,
                               tuple(getattr(layer, n) for n in names), self.int8_activations,
                               getattr(layer, "input_scale", None), self.batch_invariant)

    def apply(self, layer: nn.Module, x: torch.Tensor,
              bias: torch.Tensor | None = None) -> torch.Tensor:
        if not on_cuda(x):
            return super().apply(layer, x, bias)
        return self._gemm(layer, x, bias)

    def _gemm(self, layer: nn.Module, x: torch.Tensor,
              bias: torch.Tensor | None) -> torch.Tensor:
        from tokenmill.quantization.triton_block_gemm import block_linear

        k = block_tiles.unpack(self.blocks_kernel(layer))  # (CPU tensors routed here by tests)
        return block_linear(x, k.kind, k.group, *k.tensors[:2],
                            k.tensors[2] if len(k.tensors) > 2 else None, k.input_scale, bias)

    def embed(self, layer: nn.Module, ids: torch.Tensor) -> torch.Tensor:
        if not on_cuda(ids):
            return super().embed(layer, ids)
        k = block_tiles.unpack(self.blocks_kernel(layer))
        rows = CPULinearKernel(k.kind, k.group, tuple(t[ids] for t in k.tensors))
        return dequantize(rows).to(getattr(layer, "compute_dtype", torch.float32))
