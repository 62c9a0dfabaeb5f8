"""Weights quantized while loading a float checkpoint: `int8` and `int4` (vLLM-style names for
in-flight quantization; nothing to prepare offline).

- int8: Q8_0, one float16 scale per 32 weights. Per-output-channel int8 kept only 91% top-1
  agreement on SmolLM2, whose activations carry outliers 15-34x their RMS; 32-blocks keep
  97-99% (benchmarks/quant_quality.py).
- int4: 4-bit groups of INT4_GROUP (32, Q4_1's; 32 also in a layer whose inputs a larger
  group does not divide) with a scale and an offset each (asymmetric round to nearest), after
  an activation-aware scale search per layer (awq_search.py) when calibration activations are
  given. NOTE: a float checkpoint that is itself a Q4_1 expansion (SmolLM2's, from its GGUF)
  comes back exactly at G = 32; benchmarks/quant_quality.py's "int4/64" measures groups of 64,
  where the loss is real.
Embedding tables and the LM head go to Q8_0 in both modes, as llama.cpp's Q4 files keep them
in 8 bits, and multiply float activations even with int8_activations: the logits are where
rounding the activations cost most agreement (benchmarks/RESULTS.md).

The checkpoint fills a float `weight` like the unquantized method's (same loaders, same
sharding); `process_weights_after_loading` replaces it by its blocks.
"""

from __future__ import annotations

import torch
from torch import nn

from tokenmill.quantization.awq_search import search_scale
from tokenmill.quantization.base import (
    CPULinearKernel,
    LinearMethodBase,
    QuantizationConfig,
    int8_activations_for,
    new_param,
    replace_param,
)
from tokenmill.quantization.block_method import BlockLinearMethod
from tokenmill.quantization.blocks import quantize_q4, quantize_q8_0

# int4's group size (a module setting: benchmarks/quant_quality.py's "int4/64" changes it)
INT4_GROUP = 32


class LoadTimeQuantMethod(BlockLinearMethod):
    def __init__(self, kind: int, group: int, int8_activations: bool = False,
                 activations: dict[str, torch.Tensor] | None = None,
                 batch_invariant: bool = True) -> None:
        super().__init__(kind, group, int8_activations, batch_invariant)
        # module path → calibration inputs (rows, K), for the 4-bit scale search
        self.activations = activations or {}

    def create_weights(self, layer: nn.Module, input_size: int, output_sizes: list[int],
                       dtype: torch.dtype) -> None:
        # The method's group where it divides the layer's inputs, else blocks of 32.
        layer.group_size = self.group if input_size % self.group == 0 else 32
        if input_size % 32:
            raise ValueError(f"{'int8' if self.kind == CPULinearKernel.Q8_0 else 'int4'} "
                             f"quantization needs input sizes divisible by 32; a layer of "
                             f"this model has {input_size}")
        layer.weight = new_param((sum(output_sizes), input_size), dtype, output_dim=0,
                                 input_dim=1)
        layer.compute_dtype = dtype  # the activations' (CUDA: embedding rows come out in it)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        w = layer.weight.data
        replace_param(layer, "weight", None)
        if self.kind == CPULinearKernel.Q8_0:
            self.set_blocks(layer, *quantize_q8_0(w))
            return
        group = layer.group_size
        x = self.activations.pop(getattr(layer, "prefix", ""), None)
        # the calibration inputs come from a CPU forward; the search runs where the weight is
        s = None if x is None else search_scale(w, x.to(w.device), group)[0]
        if s is not None:  # the kernel multiplies x by 1 / s, the weight holds W s
            w = w * s
            replace_param(layer, "input_scale", (1.0 / s).float().contiguous())
        self.set_blocks(layer, *quantize_q4(w, group))


class Int8Config(QuantizationConfig):
    name = "int8"
    runs_on_cuda = True

    def __init__(self, int8_activations: bool = False, batch_invariant: bool = True) -> None:
        self.batch_invariant = batch_invariant
        self.methods = {acts: LoadTimeQuantMethod(CPULinearKernel.Q8_0, 32, acts,
                                                  batch_invariant=batch_invariant)
                        for acts in (False, True)}  # by int8 activations
        self.int8_activations = int8_activations
        self.embedding = self.methods[False]

    def linear_method(self, prefix: str) -> LinearMethodBase:
        return self.methods[int8_activations_for(prefix, self.int8_activations)]

    def embedding_method(self, prefix: str) -> LinearMethodBase:
        return self.embedding


class Int4Config(QuantizationConfig):
    name = "int4"
    runs_on_cuda = True

    def __init__(self, group: int | None = None, int8_activations: bool = False,
                 activations: dict[str, torch.Tensor] | None = None,
                 batch_invariant: bool = True) -> None:
        self.batch_invariant = batch_invariant
        self.methods = {acts: LoadTimeQuantMethod(CPULinearKernel.Q4, group or INT4_GROUP,
                                                  acts, activations, batch_invariant)
                        for acts in (False, True)}  # by int8 activations
        self.int8_activations = int8_activations
        self.embedding = LoadTimeQuantMethod(CPULinearKernel.Q8_0, 32,
                                             batch_invariant=batch_invariant)

    def linear_method(self, prefix: str) -> LinearMethodBase:
        return self.methods[int8_activations_for(prefix, self.int8_activations)]

    def embedding_method(self, prefix: str) -> LinearMethodBase:
        return self.embedding
