"""Weights quantized while loading a float checkpoint: `int8` and `int4` (vLLM-style names for
in-flight quantization; nothing to prepare offline).

- int8: Q8_0, one float16 scale per 32 weights. Per-output-channel int8 kept only 91% top-1
  agreement on SmolLM2, whose activations carry outliers 15-34x their RMS; 32-blocks keep
  97-99% (benchmarks/quant_quality.py).
- int4: 4-bit groups of `group` (32 by default) with a scale and an offset each (asymmetric
  round to nearest), the Q4_1 numbers at G = 32.
Embedding tables and the LM head go to Q8_0 in both modes, as llama.cpp's Q4 files keep them
in 8 bits: 4-bit logits cost far more agreement than 4-bit layers.

The checkpoint fills a float `weight` like the unquantized method's (same loaders, same
sharding); `process_weights_after_loading` replaces it by its blocks.
"""

from __future__ import annotations

import torch
from torch import nn

from tokenmill.quantization.base import (
    CPULinearKernel,
    LinearMethodBase,
    QuantizationConfig,
    new_param,
    replace_param,
)
from tokenmill.quantization.block_method import BlockLinearMethod
from tokenmill.quantization.blocks import quantize_q4, quantize_q8_0


class LoadTimeQuantMethod(BlockLinearMethod):
    def create_weights(self, layer: nn.Module, input_size: int, output_sizes: list[int],
                       dtype: torch.dtype) -> None:
        if input_size % self.group:
            raise ValueError(f"{'int8' if self.kind == CPULinearKernel.Q8_0 else 'int4'} "
                             f"quantization needs input sizes divisible by {self.group}; a "
                             f"layer of this model has {input_size}")
        layer.weight = new_param((sum(output_sizes), input_size), dtype, output_dim=0,
                                 input_dim=1)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        w = layer.weight.data
        replace_param(layer, "weight", None)
        if self.kind == CPULinearKernel.Q8_0:
            self.set_blocks(layer, *quantize_q8_0(w))
        else:
            self.set_blocks(layer, *quantize_q4(w, self.group))


class Int8Config(QuantizationConfig):
    name = "int8"

    def __init__(self, int8_activations: bool = False) -> None:
        self.method = LoadTimeQuantMethod(CPULinearKernel.Q8_0, 32, int8_activations)

    def linear_method(self, prefix: str) -> LinearMethodBase:
        return self.method


class Int4Config(QuantizationConfig):
    name = "int4"

    def __init__(self, group: int = 32, int8_activations: bool = False) -> None:
        self.method = LoadTimeQuantMethod(CPULinearKernel.Q4, group, int8_activations)
        self.embedding = LoadTimeQuantMethod(CPULinearKernel.Q8_0, 32, int8_activations)

    def linear_method(self, prefix: str) -> LinearMethodBase:
        return self.method

    def embedding_method(self, prefix: str) -> LinearMethodBase:
        return self.embedding
