"""GGUF weights served in their own block form (`quantization="gguf"`), as llama.cpp does.

The loader (model_loader/gguf_loader.py `iterate_gguf` with raw_types) hands each quantized
tensor over as its raw uint8 block rows (N, bytes per row), read from the gguf package's
memory map; llama.cpp's q/k row permutation moves whole rows, so un-permuting raw rows needs
no requantizing.
`process_weights_after_loading` splits the rows' blocks into the kernels' struct-of-arrays
form, bit for bit:

    Q8_0  block = d (float16) + 32 x int8            → Q8_0 (q, d)
    Q4_1  block = d, m (float16) + 16 bytes nibbles   → Q4 (q, d, m), G = 32
    Q4_0  block = d (float16) + 16 bytes nibbles      → Q4 with m = -8 d (exact)
F32 / F16 / BF16 tensors are served dense. Other types (K-quants, IQ) are refused at start-up
with the list of supported ones. A merged layer (qkv, gate_up) needs one type for all its
parts (llama.cpp's Q4_0 / Q4_1 / Q8_0 files have that).
"""

from __future__ import annotations

from fractions import Fraction

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
from tokenmill.quantization.unquantized import UnquantizedLinearMethod

# GGML type name → (bytes per block of 32 weights, the kernels' kind)
BLOCK_TYPES = {"Q8_0": (34, CPULinearKernel.Q8_0), "Q4_1": (20, CPULinearKernel.Q4),
               "Q4_0": (18, CPULinearKernel.Q4)}
DENSE_TYPES = ("F32", "F16", "BF16")
SUPPORTED_TYPES = (*BLOCK_TYPES, *DENSE_TYPES)


def split_blocks(raw: torch.Tensor, type_name: str) -> tuple[torch.Tensor, ...]:
    """Raw block rows (N, K / 32 * block bytes) uint8 → the kernels' tensors (see module doc)."""
    size, _ = BLOCK_TYPES[type_name]
    N = raw.shape[0]
    b = raw.view(N, -1, size)  # (N, blocks, bytes)
    d = b[:, :, 0:2].contiguous().view(torch.float16).view(N, -1)
    if type_name == "Q8_0":
        return b[:, :, 2:].contiguous().view(torch.int8).view(N, -1), d
    if type_name == "Q4_1":
        m = b[:, :, 2:4].contiguous().view(torch.float16).view(N, -1)
        return b[:, :, 4:].reshape(N, -1).contiguous(), d, m
    return b[:, :, 2:].reshape(N, -1).contiguous(), d, (d.float() * -8).half()


class GGUFBlockMethod(BlockLinearMethod):
    """A layer whose GGUF tensors are all of one block type."""

    def __init__(self, type_name: str, int8_activations: bool = False,
                 batch_invariant: bool = True) -> None:
        self.type_name = type_name
        super().__init__(BLOCK_TYPES[type_name][1], 32, int8_activations, batch_invariant)

    def create_weights(self, layer: nn.Module, input_size: int, output_sizes: list[int],
                       dtype: torch.dtype) -> None:
        if input_size % 32:
            raise ValueError(f"GGUF {self.type_name} rows of {input_size} weights are not "
                             "whole blocks of 32")
        size = BLOCK_TYPES[self.type_name][0]
        layer.qweight = new_param((sum(output_sizes), input_size // 32 * size), torch.uint8,
                                  output_dim=0, input_dim=1, input_ratio=Fraction(size, 32))

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        raw = layer.qweight.data
        replace_param(layer, "qweight", None)
        self.set_blocks(layer, *split_blocks(raw, self.type_name))


class GGUFConfig(QuantizationConfig):
    """Each layer's method from the types of its tensors in the file."""

    name = "gguf"

    def __init__(self, tensor_types: dict[str, str], prepack: bool,
                 packed_modules: dict[str, tuple[str, int | str]],
                 int8_activations: bool = False, batch_invariant: bool = True) -> None:
        self.int8_activations = int8_activations
        self.batch_invariant = batch_invariant
        # HF parameter name ("model.layers.0.self_attn.q_proj.weight") → GGML type name
        self.tensor_types = tensor_types
        self.dense = UnquantizedLinearMethod(prepack, batch_invariant)
        self.packed_modules = packed_modules
        bad = sorted({t for t in tensor_types.values() if t not in SUPPORTED_TYPES})
        if bad:
            raise ValueError(f"GGUF tensor types {', '.join(bad)} cannot be served natively "
                             f"(quantization='gguf' supports {', '.join(SUPPORTED_TYPES)}); "
                             "pass quantization='none' to serve the file dequantized to float32")

    def _types_of(self, prefix: str) -> set[str]:
        """The GGUF types of the checkpoint tensors that make up the module at `prefix`."""
        parent, _, leaf = prefix.rpartition(".")
        parts = [f"{parent}.{ckpt}" for ckpt, (merged, _) in self.packed_modules.items()
                 if merged == leaf] or [prefix]
        found = {self.tensor_types.get(f"{p}.weight") for p in parts}
        if None in found:
            raise ValueError(f"the GGUF file has no weight for {prefix}")
        return found  # type: ignore[return-value]

    def linear_method(self, prefix: str) -> LinearMethodBase:
        types = self._types_of(prefix)
        if len(types) > 1:
            raise ValueError(f"{prefix} merges tensors of GGUF types {sorted(types)}; "
                             "quantization='gguf' needs one type per merged layer")
        (t,) = types
        if t in DENSE_TYPES:
            return self.dense
        return GGUFBlockMethod(t, int8_activations_for(prefix, self.int8_activations),
                               self.batch_invariant)

    def embedding_method(self, prefix: str) -> LinearMethodBase:
        """As linear_method, but float activations always: rounding them cost most agreement
        in the logits (benchmarks/RESULTS.md)."""
        method = self.linear_method(prefix)
        if isinstance(method, GGUFBlockMethod) and method.int8_activations:
            return GGUFBlockMethod(method.type_name, batch_invariant=self.batch_invariant)
        return method

