"""Quantized expert weights: the stacked w13 (E, 2I, H) and w2 (E, H, I) of a FusedMoE layer
(layers/fused_moe.py) in the blocks of the load-time formats (`int8`: Q8_0; `int4`: 4-bit
groups, round to nearest), one block set per expert, multiplied by the same C++ `linear` op
as every quantized linear layer (its CPULinearKernel per expert and matrix).

The checkpoint fills the float stacked weights as for an unquantized model (same loaders, same
tensor-parallel split); `process_weights_after_loading` quantizes each expert's matrices and
drops the floats. A GGUF file's expert blocks are served as stored (quantization/
gguf_experts.py); AWQ / GPTQ experts are refused by name: their expert tensors would need
loaders of their own.

Agreement with float32 is measured in tests/models/test_moe.py (the layer's relative error,
the model's greedy tokens).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from tokenmill.quantization.base import CPULinearKernel, QuantizationConfig, replace_param
from tokenmill.quantization.blocks import quantize_q4, quantize_q8_0
from tokenmill.quantization.gguf import BLOCK_TYPES
from tokenmill.quantization.gguf_experts import GGUFExpertsMethod, expert_types
from tokenmill.quantization.load_time import INT4_GROUP, LoadTimeQuantMethod


class MoEQuantMethod:
    """How a FusedMoE layer's experts are stored and multiplied (one per layer)."""

    def __init__(self, kind: int, group: int, int8_activations: bool,
                 batch_invariant: bool = True) -> None:
        self.kind, self.group, self.int8_activations = kind, group, int8_activations
        self.batch_invariant = batch_invariant

    def _group(self, input_size: int) -> int:
        if input_size % 32:
            raise ValueError(f"quantized experts need input sizes divisible by 32; this "
                             f"model's experts have {input_size}")
        if self.kind == CPULinearKernel.Q8_0:
            return 32
        return self.group if input_size % self.group == 0 else 32

    def _quantize(self, w: torch.Tensor, group: int) -> tuple[torch.Tensor, ...]:
        if self.kind == CPULinearKernel.Q8_0:
            return quantize_q8_0(w)
        return quantize_q4(w, group)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Replace layer.w13 / w2 by per-expert blocks `w13_q, w13_d(, w13_m)`, `w2_*`."""
        for name in ("w13", "w2"):
            w = getattr(layer, name).data  # (E, N, K)
            group = self._group(w.shape[-1])
            parts = [self._quantize(w[e], group) for e in range(w.shape[0])]
            replace_param(layer, name, None)
            for suffix, i in (("q", 0), ("d", 1), ("m", 2)):
                if i < len(parts[0]):
                    replace_param(layer, f"{name}_{suffix}",
                                  torch.stack([p[i] for p in parts]).contiguous())
            setattr(layer, f"{name}_group", group)

    def kernel(self, layer: nn.Module, name: str, e: int) -> CPULinearKernel:
        """Expert e's `name` (w13 | w2) matrix as the C++ linear op reads it."""
        suffixes = ("q", "d", "m") if self.kind == CPULinearKernel.Q4 else ("q", "d")
        return CPULinearKernel(self.kind, getattr(layer, f"{name}_group"),
                               tuple(getattr(layer, f"{name}_{s}")[e] for s in suffixes),
                               self.int8_activations, batch_invariant=self.batch_invariant)


def gguf_experts_method(quant: Any, prefix: str) -> GGUFExpertsMethod | None:
    """A GGUF file's experts at `prefix` in their blocks; None where the file stores them as
    float tensors (F32 / F16 / BF16: loaded as float32, as an unquantized model's)."""
    types = expert_types(quant.tensor_types, prefix)
    blocks = [t for t in types.values() if t in BLOCK_TYPES]
    if not blocks:
        return None
    if len(blocks) < len(types):
        raise ValueError(f"{prefix} mixes float and block GGUF expert tensors ({types}); pass "
                         "quantization='none' to serve the file in float32")
    if quant.int8_activations:
        raise ValueError("int8_activations is not implemented for GGUF expert weights; "
                         "leave it off")
    return GGUFExpertsMethod(types, quant.batch_invariant)


def moe_quant_method(quant: QuantizationConfig | None,
                     prefix: str) -> MoEQuantMethod | GGUFExpertsMethod | None:
    """The experts' method under the model's quantization (None: float weights);
    ValueError for a format whose expert weights are not supported."""
    if quant is None or quant.name == "none":
        return None
    if torch.get_default_device().type != "cpu":  # the model is being built there
        raise ValueError(f"quantization={quant.name!r}: quantized MoE experts run on CPU "
                         "only (the C++ kernels); serve this MoE model unquantized on CUDA")
    if quant.name == "gguf":  # the file's own expert blocks, or None: float tensors
        return gguf_experts_method(quant, prefix)
    method = quant.linear_method(prefix) if quant.name in ("int8", "int4") else None
    if not isinstance(method, LoadTimeQuantMethod):
        raise ValueError(f"quantization={quant.name!r} is not supported for MoE expert "
                         "weights (int8 and int4 are); load the model with one of those or "
                         "unquantized")
    return MoEQuantMethod(method.kind, method.group or INT4_GROUP, method.int8_activations,
                          method.batch_invariant)
