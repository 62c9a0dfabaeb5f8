"""4-bit checkpoints that users bring from the Hugging Face hub: AWQ (AutoAWQ's GEMM layout)
and GPTQ (AutoGPTQ / GPTQModel), read from safetensors and unpacked at load into the Q4 layout
(quantization/blocks.py) that every 4-bit format shares.

AWQ GEMM, for a layer of K inputs and N outputs with groups of G inputs:
    qweight int32 (K, N/8): word j of row k holds outputs 8j + AWQ_ORDER[i] in bits 4i..4i+3
    qzeros  int32 (K/G, N/8), the same packing; scales float16 (K/G, N)
    w[k, n] = scales[k/G, n] * (q[k, n] - z[k/G, n])
GPTQ:
    qweight int32 (K/8, N): word i of column n holds inputs 8i + j in bits 4j..4j+3
    qzeros  int32 (K/G, N/8): word j holds outputs 8j + i in bits 4i..4i+3, stored minus one
            (checkpoint_format "gptq"; "gptq_v2" stores them as they are)
    scales  float16 (K/G, N); g_idx int32 (K,): the group of each input
    w[k, n] = scales[g_idx[k], n] * (q[k, n] - z[g_idx[k], n])
Only 4 bits, and GPTQ only with g_idx[k] = k / G (desc_act off, or an act-order checkpoint
whose groups happen to be in order): both are checked at start-up, with a clear error.
"""

from __future__ import annotations

from fractions import Fraction
from typing import Any

import torch
from torch import nn

from tokenmill.quantization.base import (
    CPULinearKernel,
    LinearMethodBase,
    QuantizationConfig,
    int8_activations_for,
    new_param,
    replace_param,
)
from tokenmill.quantization.block_method import BlockLinearMethod
from tokenmill.quantization.blocks import from_zero_points
from tokenmill.quantization.unquantized import UnquantizedLinearMethod

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # output column of nibble i within a word
_SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)


def unpack_int32(words: torch.Tensor, dim: int) -> torch.Tensor:
    """Eight 4-bit values per int32, nibble i at bits 4i: expand `dim` eightfold (nibble i of
    word j becomes index 8j + i)."""
    w = words.to(torch.int32).unsqueeze(dim + 1 if dim >= 0 else dim)
    shape = [1] * w.dim()
    shape[dim + 1 if dim >= 0 else dim] = 8
    vals = (w >> _SHIFTS.view(shape)) & 0xF
    out_shape = list(words.shape)
    out_shape[dim] *= 8
    return vals.reshape(out_shape)


def _awq_unorder(values: torch.Tensor) -> torch.Tensor:
    """Undo AWQ's column order within each word: (..., N) as unpacked → (..., N) by column."""
    lead, N = values.shape[:-1], values.shape[-1]
    v = values.reshape(*lead, N // 8, 8)
    inverse = torch.tensor(AWQ_ORDER).argsort()
    return v[..., inverse].reshape(*lead, N)


class _ZeroPointMethod(BlockLinearMethod):
    def __init__(self, group: int, int8_activations: bool, batch_invariant: bool = True) -> None:
        super().__init__(CPULinearKernel.Q4, group, int8_activations, batch_invariant)

    def _group(self, input_size: int) -> int:
        G = input_size if self.group == -1 else self.group
        if G % 32 or input_size % G:
            raise ValueError(f"4-bit groups of {G} cannot serve a layer of {input_size} "
                             "inputs: groups must be a multiple of 32 dividing the input size")
        return G

    def _zeros_and_scales(self, layer: nn.Module, input_size: int, N: int) -> int:
        """Register qzeros (K/G, N/8) int32 and scales (K/G, N) float16, laid out alike in
        both formats; returns N."""
        G = self._group(input_size)
        layer.group_size = G
        layer.qzeros = new_param((input_size // G, N // 8), torch.int32, input_dim=0,
                                 output_dim=1, input_ratio=Fraction(1, G),
                                 output_ratio=Fraction(1, 8))
        layer.scales = new_param((input_size // G, N), torch.float16, input_dim=0, output_dim=1,
                                 input_ratio=Fraction(1, G))
        return N


class AWQLinearMethod(_ZeroPointMethod):
    def create_weights(self, layer: nn.Module, input_size: int, output_sizes: list[int],
                       dtype: torch.dtype) -> None:
        N = self._zeros_and_scales(layer, input_size, sum(output_sizes))
        layer.qweight = new_param((input_size, N // 8), torch.int32, input_dim=0, output_dim=1,
                                  output_ratio=Fraction(1, 8))

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        q = _awq_unorder(unpack_int32(layer.qweight.data, 1))  # (K, N)
        z = _awq_unorder(unpack_int32(layer.qzeros.data, 1))  # (K/G, N)
        s = layer.scales.data
        for name in ("qweight", "qzeros", "scales"):
            replace_param(layer, name, None)
        self.set_blocks(layer, *from_zero_points(q, z, s, layer.group_size))


class GPTQLinearMethod(_ZeroPointMethod):
    def __init__(self, group: int, int8_activations: bool, zeros_minus_one: bool,
                 batch_invariant: bool = True) -> None:
        super().__init__(group, int8_activations, batch_invariant)
        self.zeros_minus_one = zeros_minus_one

    def create_weights(self, layer: nn.Module, input_size: int, output_sizes: list[int],
                       dtype: torch.dtype) -> None:
        N = self._zeros_and_scales(layer, input_size, sum(output_sizes))
        layer.qweight = new_param((input_size // 8, N), torch.int32, input_dim=0, output_dim=1,
                                  input_ratio=Fraction(1, 8))
        layer.g_idx = new_param((input_size,), torch.int32, input_dim=0)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        G = layer.group_size
        K = layer.g_idx.shape[0]
        if not torch.equal(layer.g_idx.data.long(), torch.arange(K) // G):
            raise ValueError(f"{layer.prefix}: this GPTQ checkpoint reorders its input groups "
                             "(desc_act / act-order with g_idx != k // group_size), which "
                             "tokenmill does not serve; use a checkpoint quantized without "
                             "desc_act")
        q = unpack_int32(layer.qweight.data, 0)  # (K, N)
        z = unpack_int32(layer.qzeros.data, 1) + (1 if self.zeros_minus_one else 0)  # (K/G, N)
        if z.max() > 15:
            raise ValueError(f"{layer.prefix}: GPTQ zero points out of range")
        s = layer.scales.data
        for name in ("qweight", "qzeros", "scales", "g_idx"):
            replace_param(layer, name, None)
        self.set_blocks(layer, *from_zero_points(q, z, s, G))


class Int4CheckpointConfig(QuantizationConfig):
    """From a checkpoint's `quantization_config` (config.json)."""

    runs_on_cuda = True

    def __init__(self, name: str, hf_quant_config: dict[str, Any], prepack: bool,
                 int8_activations: bool = False, batch_invariant: bool = True) -> None:
        self.name = name
        self.batch_invariant = batch_invariant
        cfg = hf_quant_config
        method = str(cfg.get("quant_method", "")).lower()
        if method != name:
            raise ValueError(f"quantization={name!r} but the checkpoint's quantization_config "
                             f"says quant_method={method or None!r}")
        bits = cfg.get("bits", cfg.get("w_bit"))
        if bits != 4:
            raise ValueError(f"{name} checkpoints with {bits} bits are not supported (4 only)")
        group = int(cfg.get("group_size", cfg.get("q_group_size", 128)))
        if name == "awq":
            version = str(cfg.get("version", "gemm")).lower()
            if version != "gemm" or not cfg.get("zero_point", True):
                raise ValueError(f"AWQ version {version!r} (zero_point="
                                 f"{cfg.get('zero_point', True)}) is not supported; the GEMM "
                                 "layout with zero points is")
            self.methods: dict[bool, BlockLinearMethod] = {
                acts: AWQLinearMethod(group, acts, batch_invariant) for acts in (False, True)}
        else:
            fmt = str(cfg.get("checkpoint_format", "gptq")).lower()
            if fmt not in ("gptq", "gptq_v2"):
                raise ValueError(f"GPTQ checkpoint_format {fmt!r} is not supported "
                                 "(gptq, gptq_v2)")
            self.methods = {acts: GPTQLinearMethod(group, acts, zeros_minus_one=fmt == "gptq",
                                                   batch_invariant=batch_invariant)
                            for acts in (False, True)}  # by int8 activations
        self.int8_activations = int8_activations
        self.skip = list(cfg.get("modules_to_not_convert") or [])
        self.dense = UnquantizedLinearMethod(prepack, batch_invariant)

    def linear_method(self, prefix: str) -> LinearMethodBase:
        if any(s in prefix for s in self.skip):
            return self.dense
        return self.methods[int8_activations_for(prefix, self.int8_activations)]

    def embedding_method(self, prefix: str) -> LinearMethodBase:
        return self.dense  # these checkpoints keep the embedding and LM head in float
