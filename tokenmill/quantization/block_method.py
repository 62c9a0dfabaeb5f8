"""The method objects of block-quantized weights (Q8_0 and Q4 layouts, quantization/blocks.py):
what every quantized format becomes after loading, whatever its checkpoint held.

Subclasses differ only in what the checkpoint holds and how `process_weights_after_loading`
turns it into blocks (`set_blocks`); the kernel descriptor, `apply` (the C++ `linear`
op at every M) and row lookups are shared. The blocks are the layer's parameters `blocks_q`,
`blocks_d` and, for 4-bit, `blocks_m` (and `input_scale` where an activation-aware search
scaled the weight's input channels); no float copy of the weight is kept.
"""

from __future__ import annotations

import torch
from torch import nn

from tokenmill.quantization.base import CPULinearKernel, LinearMethodBase, replace_param


class BlockLinearMethod(LinearMethodBase):
    def __init__(self, kind: int, group: int, int8_activations: bool = False,
                 batch_invariant: bool = True) -> None:
        if kind not in (CPULinearKernel.Q8_0, CPULinearKernel.Q4):
            raise ValueError(f"not a block kind: {kind}")
        self.kind, self.group = kind, group
        # Every step multiplies int8-quantized activations (EngineConfig option).
        self.int8_activations = int8_activations
        self.batch_invariant = batch_invariant

    @staticmethod
    def set_blocks(layer: nn.Module, q: torch.Tensor, d: torch.Tensor,
                   m: torch.Tensor | None = None) -> None:
        for name, value in (("blocks_q", q), ("blocks_d", d), ("blocks_m", m)):
            replace_param(layer, name, None if value is None else value.contiguous())

    def cpu_kernel(self, layer: nn.Module) -> CPULinearKernel | None:
        q = getattr(layer, "blocks_q", None)
        if q is None or not q.is_cpu:
            return None
        names = ("blocks_q", "blocks_d") + (("blocks_m",) if self.kind == CPULinearKernel.Q4
                                             else ())
        group = getattr(layer, "group_size", self.group)  # set where it varies by layer
        return CPULinearKernel(self.kind, group, tuple(getattr(layer, n) for n in names),
                               self.int8_activations, getattr(layer, "input_scale", None),
                               self.batch_invariant)
