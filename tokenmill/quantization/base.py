"""The interface every weight format implements, in the shape of vLLM's `LinearMethodBase`.

A linear layer (and the embedding / LM head) owns a method object; the layer never looks at
its weight tensors itself:

- `create_weights(layer, input_size, output_sizes, dtype)` registers the parameters the
  checkpoint fills, each tagged with how it shards (`set_weight_attrs`: which dims are the
  output and input features, and how many stored units one feature takes on each, e.g. 1/8 for
  eight 4-bit values packed in an int32, 1/G for one scale per group of G inputs), so that the
  layers' weight loaders (layers/linear.py) narrow any format the same way;
- `process_weights_after_loading(layer)` turns what was loaded into what the kernels read
  (quantize a float weight, unpack a checkpoint's int32 words, split GGUF blocks, prepack a
  oneDNN weight) and frees what no kernel reads;
- `apply(layer, x, bias)` computes x @ W^T + bias;
- `cpu_kernel(layer)` describes the weight to the C++ `linear` op (csrc/linear_cpu.h) as a
  `CPULinearKernel`: the fused decode call (models/cpu_decode.py) takes each layer's weight
  through it, so a new format is written once, here, and runs in every path;
- `embed(layer, ids)` looks rows up (embedding tables; tied LM heads share them).

Invariant: after `process_weights_after_loading`, every tensor `cpu_kernel` names is a
parameter of the layer (moved to huge pages with the rest) and nothing else holds the weight.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

import torch
from torch import nn

from tokenmill.layers import cpu_ops


@dataclass(frozen=True)
class CPULinearKernel:
    """A weight as csrc/linear_cpu.h reads it: (kind, group size, tensors)."""

    DENSE = 0  # (W (N, K) float32,)
    Q8_0 = 1  # (q (N, K) int8, d (N, K/32) float16): w = d q
    Q4 = 2  # (q (N, K/2) uint8, d (N, K/G) float16, m (N, K/G) float16): w = d q + m
    # GGUF block types read in place: (raw block rows (N, K / QK * block bytes) uint8,)
    Q5_0, Q5_1, Q4_K, Q5_K, Q6_K = 3, 4, 5, 6, 7
    Q3_K, Q2_K, IQ4_XS, IQ4_NL = 11, 12, 13, 14
    # dense weights kept in half precision, widened to float32 in registers: (W (N, K),)
    BF16, F16 = 8, 9
    # dense bfloat16 weights multiplied in bfloat16: x rounded to bf16, vdpbf16ps's products,
    # float32 sums (csrc/linear_bf16.h; emulated without AVX512-BF16): (W (N, K) bfloat16,)
    BF16_PRODUCTS = 10
    # BF16_PRODUCTS's W packed at load for AMX tiles where the CPU has AMX-BF16, multiplied
    # there (csrc/linear_bf16_amx.h): (W tiles (N/16, K/2, 16, 2) bfloat16,), row 16 g + j's
    # pair p at [g, p, j]
    BF16_TILES = 16
    # Q8_0's and Q4's blocks packed at load into tiles of 16 rows on AVX-512 VNNI builds
    # (multiplied on AMX-INT8 where the CPU has it), x rounded per 32-block as for those
    # kinds (csrc/linear_block_tiles.h;
    # quantization/block_tiles.py): Q8_0_TILES (q tiles (N/16, K/32, 512) int8, d (N/16, K/32,
    # 16) float16), Q4_TILES (q tiles (N/16, K/32, 256) uint8, d, m (N/16, K/G, 16) float16)
    Q8_0_TILES, Q4_TILES = 17, 18
    # Q4_K's raw super-blocks packed at load into tiles of 16 rows on AVX2 / AVX-512 builds, x
    # rounded as for Q4_K (csrc/linear_kquant_tiles_layout.h; quantization/kquant_tiles.py):
    # (q tiles (N/16, K/256, 2368) uint8,)
    Q4_K_TILES = 19
    # Q6_K's raw super-blocks packed at load into tiles of 16 rows on AVX-512 VNNI builds, x
    # rounded as for Q6_K (csrc/linear_q6k_tiles.h; quantization/q6k_tiles.py):
    # (q tiles (N/16, K/256, 3360) uint8,)
    Q6_K_TILES = 20
    # a merged layer of parts of different kinds: (meta (P, 3) int64 [kind, group, tensor
    # count], then each part's tensors); outputs side by side
    PARTS = 15

    kind: int
    group: int
    tensors: tuple[torch.Tensor, ...]
    # Quantized kinds: multiply int8-quantized activations at every M (llama.cpp's numbers,
    # faster) instead of float32 ones (int16-rounded per 32-block on AVX-512 VNNI builds,
    # exact against the dequantized weight elsewhere; csrc/linear_cpu.h).
    int8_activations: bool = False
    # (K,): x is multiplied by it before the product (activation-aware 4-bit weights hold
    # W / s per input channel; quantization/awq_search.py). None: no scaling.
    input_scale: torch.Tensor | None = None
    # Every row summed in one order whatever the step's number of rows (csrc/linear_dot.h):
    # a request's result does not depend on its neighbours. False: the fastest kernel for
    # each M (EngineConfig.batch_invariant).
    batch_invariant: bool = True
    # The method multiplies through this kernel only in steps of at most this many rows (a
    # float32 weight without batch invariance: larger steps take oneDNN's prepacked copy);
    # None: in every step. The fused CPU layers call (models/cpu_decode.py) reads it too.
    max_rows: int | None = None

    def runs(self, rows: int) -> bool:
        """Whether the method takes this kernel for a step of `rows` rows."""
        return self.max_rows is None or rows <= self.max_rows

    def as_args(self) -> tuple[int, int, list[torch.Tensor], bool, torch.Tensor | None, bool]:
        return (self.kind, self.group, list(self.tensors), self.int8_activations,
                self.input_scale, self.batch_invariant)


def merged_kernel(parts: list[CPULinearKernel], int8_activations: bool = False,
                  batch_invariant: bool = True) -> CPULinearKernel:
    """One kernel for a layer whose row ranges are `parts` (outputs side by side): the part
    itself when there is one, else CPULinearKernel.PARTS."""
    if len(parts) == 1:
        return parts[0]
    meta = torch.tensor([[k.kind, k.group, len(k.tensors)] for k in parts])
    return CPULinearKernel(CPULinearKernel.PARTS, 0,
                           (meta, *(t for k in parts for t in k.tensors)),
                           int8_activations, None, batch_invariant)


def set_weight_attrs(param: nn.Parameter, output_dim: int | None = None,
                     input_dim: int | None = None, output_ratio: Fraction = Fraction(1),
                     input_ratio: Fraction = Fraction(1)) -> nn.Parameter:
    """Tag how `param` shards: `output_dim` / `input_dim` are its dims along the layer's output
    and input features (None: it does not split along them), `*_ratio` the stored units per
    feature on that dim (1/8: eight features per int32 word; 1/G: one scale per group)."""
    param.output_dim, param.input_dim = output_dim, input_dim
    param.output_ratio, param.input_ratio = Fraction(output_ratio), Fraction(input_ratio)
    return param


def new_param(shape: tuple[int, ...], dtype: torch.dtype, **attrs: Any) -> nn.Parameter:
    return set_weight_attrs(nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False),
                            **attrs)


def replace_param(layer: nn.Module, name: str, value: torch.Tensor | None) -> None:
    """Drop `layer.<name>` (a parameter) and, unless value is None, register `value` in its
    place: weights processed after loading stay parameters (huge pages, device moves)."""
    if name in layer._parameters:
        del layer._parameters[name]
    if value is not None:
        layer.register_parameter(name, nn.Parameter(value, requires_grad=False))


class LinearMethodBase(ABC):
    """How one layer stores and multiplies its weight (see module doc)."""

    # the kernels' summation order does not depend on a step's rows (CPULinearKernel)
    batch_invariant: bool = True

    @abstractmethod
    def create_weights(self, layer: nn.Module, input_size: int, output_sizes: list[int],
                       dtype: torch.dtype) -> None:
        """Register the layer's weight parameters for this rank: input_size features in,
        sum(output_sizes) out (several for merged layers: qkv, gate_up)."""

    def process_weights_after_loading(self, layer: nn.Module) -> None:  # noqa: B027
        """Turn loaded tensors into what `apply` reads (default: nothing to do)."""

    @abstractmethod
    def cpu_kernel(self, layer: nn.Module) -> CPULinearKernel | None:
        """The weight as the C++ `linear` op reads it, or None where it cannot (not on CPU,
        not float32 activations)."""

    def apply(self, layer: nn.Module, x: torch.Tensor,
              bias: torch.Tensor | None = None) -> torch.Tensor:
        """x (M, K) → (M, N). Default: the C++ op on the method's CPU kernel."""
        kernel = self.cpu_kernel(layer) if cpu_ops.fused(x) else None
        if kernel is None:
            raise RuntimeError(f"{type(self).__name__} runs only on CPU with the C++ kernels "
                               "built and float32 activations")
        return cpu_ops.linear(x, kernel, bias)

    def embed(self, layer: nn.Module, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` (T,) of the weight as (T, K) activations (embedding tables)."""
        kernel = self.cpu_kernel(layer)
        if kernel is None:
            raise RuntimeError(f"{type(self).__name__} cannot look rows up here")
        return cpu_ops.gather_rows(ids, kernel)


# Linear layers that keep float activations when int8 activations are asked for: the
# attention's input projection reads the RMSNorm output, whose outlier channels lose the most
# to int8 rounding (SmolLM2, benchmarks/RESULTS.md eighth session: top-1 agreement with
# float32 96.87 -> 97.46% for int8, 93.59 -> 95.38% for gguf, for 0-4% of batched
# throughput). The embedding and the LM head keep them too (their configs say so).
FLOAT_ACTIVATION_LAYERS = ("qkv_proj",)


def int8_activations_for(prefix: str, asked: bool) -> bool:
    """Whether the linear layer at `prefix` multiplies int8 activations, given the option."""
    return asked and prefix.rsplit(".", 1)[-1] not in FLOAT_ACTIVATION_LAYERS


class QuantizationConfig(ABC):
    """A weight format for a whole model: picks each layer's method object."""

    name: str
    # every method it hands out multiplies batch-invariantly (EngineConfig.batch_invariant)
    batch_invariant: bool = True
    # its methods multiply on CUDA too (Triton kernels), in the model's dtype there
    runs_on_cuda: bool = False

    @abstractmethod
    def linear_method(self, prefix: str) -> LinearMethodBase:
        """The method of the linear layer at module path `prefix` (e.g.
        'model.layers.0.self_attn.qkv_proj')."""

    def embedding_method(self, prefix: str) -> LinearMethodBase:
        """The method of an embedding table or LM head (default: the linear layers')."""
        return self.linear_method(prefix)

    def checkpoint_tensor(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """A checkpoint tensor as this format's parameters take it (default: as stored)."""
        return tensor

    def check_device(self, device: torch.device) -> None:
        """Raise ValueError when this format cannot run on `device` (CPU: the C++ kernels;
        CUDA: formats with `runs_on_cuda`, with Triton installed)."""
        if device.type == "cuda" and self.runs_on_cuda:
            from tokenmill.attention.triton_paged import triton_available

            if not triton_available():
                raise ValueError(f"quantization={self.name!r} on CUDA needs the triton "
                                 "package (it comes with torch's CUDA builds)")
            return
        if device.type != "cpu":
            where = "CPU and CUDA" if self.runs_on_cuda else "CPU only for now"
            raise ValueError(f"quantization={self.name!r} runs on {where} (kernels in "
                             f"tokenmill/csrc); device is {device.type}")
        if not cpu_ops.ops_available():
            raise ValueError(f"quantization={self.name!r} needs the C++ CPU kernels, which "
                             "could not be built here (no compiler, or TOKENMILL_CPU_KERNELS=0)")
