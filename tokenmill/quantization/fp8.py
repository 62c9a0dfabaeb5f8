"""`fp8`: W8A8 in float8 e4m3, quantized while loading a float checkpoint (vLLM's
`--quantization fp8` on a bf16 / fp16 / fp32 model; nothing to prepare offline).

- weights: one float32 scale per output channel, amax / 448 (e4m3's largest finite value),
  the channel divided by it and rounded to e4m3 (round to nearest even, as torch's cast);
- activations: one scale per token, computed at every step the same way (dynamic, as vLLM's
  per-token FP8 schemes), so no calibration is needed;
- the product: torch._scaled_mm(x_q, W_q^T, scale_a = per-token, scale_b = per-channel), the
  e4m3 products summed in float32 (CUDA: the GPU's fp8 tensor cores, sm_89 and later; CPU:
  PyTorch's reference kernel, for tests and machines without a GPU), times both scales.

Embedding tables and the LM head stay in the model's dtype (as vLLM's fp8 leaves them). The
C++ decode call does not read e4m3 weights (`cpu_kernel` is None), so on CPU every step runs
through the modules. Layers need input and output sizes divisible by 16 (the fp8 GEMMs' rule).
Lossy: agreement with the float weights is stated in tests/quantization/test_fp8.py.

A checkpoint stored in fp8 (config.json: quant_method "fp8", as Qwen3-*-FP8 and DeepSeek-V3
ship): e4m3 weights with one float32 scale per `weight_block_size` tile (`weight_scale_inv`,
128 x 128 in those), activations dynamic. On CUDA the Triton GEMM multiplies the e4m3 bytes
and their tile scales as stored (quantization/triton_block_gemm.py: dequantized in registers,
activations in the model's dtype: W8A16, as vLLM serves such checkpoints on GPUs without its
block-fp8 kernels); on CPU each weight is dequantized once at load to the model's dtype and
served dense. Either way the product is exactly the checkpoint's weights'. Layers the config
lists in `ignored_layers` / `modules_to_not_convert` are read as float. Per-tensor fp8
checkpoints, static activation scales and e5m2 are refused by name.
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
    new_param,
    replace_param,
)
from tokenmill.quantization.block_method import on_cuda
from tokenmill.quantization.unquantized import UnquantizedLinearMethod

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(R, K) float → (e4m3 (R, K), float32 scales (R, 1)): each row over amax / 448."""
    x = x.float()
    scale = x.abs().amax(dim=-1, keepdim=True).clamp(min=1e-12) / FP8_MAX
    return (x / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def fp8_linear(x: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor,
               bias: torch.Tensor | None = None) -> torch.Tensor:
    """x (M, K) @ (w_q * w_scale)^T (+ bias) → (M, N) in x's dtype; w_q (N, K) e4m3, w_scale
    (N,) float32; x quantized per token first."""
    x_q, x_scale = quantize_rows(x)
    # per-row scales produce bfloat16 on CUDA (cuBLAS's rule); CPU takes any dtype
    out_dtype = torch.bfloat16 if x.is_cuda else x.dtype
    y = torch._scaled_mm(x_q, w_q.t(), scale_a=x_scale, scale_b=w_scale.view(1, -1),
                         out_dtype=out_dtype)
    y = y.to(x.dtype)
    return y if bias is None else y + bias


class Fp8LinearMethod(LinearMethodBase):
    batch_invariant = False  # the fp8 GEMMs' summation order is the library's

    def create_weights(self, layer: nn.Module, input_size: int, output_sizes: list[int],
                       dtype: torch.dtype) -> None:
        if input_size % 16 or sum(output_sizes) % 16:
            raise ValueError(f"fp8 quantization needs layer sizes divisible by 16; a layer of "
                             f"this model is {sum(output_sizes)} x {input_size}")
        layer.weight = new_param((sum(output_sizes), input_size), dtype, output_dim=0,
                                 input_dim=1)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        w_q, scale = quantize_rows(layer.weight.data)
        replace_param(layer, "weight", None)
        replace_param(layer, "weight_fp8", w_q.contiguous())
        replace_param(layer, "weight_scale", scale.view(-1).contiguous())

    def cpu_kernel(self, layer: nn.Module) -> CPULinearKernel | None:
        return None  # the C++ kernels read no e4m3 weights

    def apply(self, layer: nn.Module, x: torch.Tensor,
              bias: torch.Tensor | None = None) -> torch.Tensor:
        return fp8_linear(x, layer.weight_fp8, layer.weight_scale, bias)


class Fp8BlockCheckpointMethod(LinearMethodBase):
    """A layer of a block-scaled fp8 checkpoint (module doc)."""

    def __init__(self, block: tuple[int, int], dense: UnquantizedLinearMethod) -> None:
        self.block, self.dense = block, dense
        self.batch_invariant = dense.batch_invariant

    def create_weights(self, layer: nn.Module, input_size: int, output_sizes: list[int],
                       dtype: torch.dtype) -> None:
        bn, bk = self.block
        if input_size % bk or any(n % bn for n in output_sizes):
            raise ValueError(f"an fp8 checkpoint's {bn} x {bk} scale tiles must divide each "
                             f"layer's parts; a layer of this model is {output_sizes} x "
                             f"{input_size} (split across tensor-parallel ranks)")
        n = sum(output_sizes)
        layer.weight = new_param((n, input_size), FP8, output_dim=0, input_dim=1)
        layer.weight_scale_inv = new_param((n // bn, input_size // bk), torch.float32,
                                           output_dim=0, input_dim=1,
                                           output_ratio=Fraction(1, bn),
                                           input_ratio=Fraction(1, bk))
        layer.compute_dtype, layer.packed_weight = dtype, None

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        w, scale = layer.weight.data, layer.weight_scale_inv.data
        if on_cuda(w):  # the Triton GEMM reads them as stored
            replace_param(layer, "weight", None)
            replace_param(layer, "weight_fp8", w)
            return
        replace_param(layer, "weight_scale_inv", None)
        replace_param(layer, "weight", dequantize_blocks(w, scale, self.block)
                      .to(layer.compute_dtype))
        self.dense.process_weights_after_loading(layer)

    def cpu_kernel(self, layer: nn.Module) -> CPULinearKernel | None:
        return self.dense.cpu_kernel(layer)  # None while the weight is e4m3 (CUDA)

    def apply(self, layer: nn.Module, x: torch.Tensor,
              bias: torch.Tensor | None = None) -> torch.Tensor:
        w = getattr(layer, "weight_fp8", None)
        if w is None:
            return self.dense.apply(layer, x, bias)
        from tokenmill.quantization.triton_block_gemm import fp8_block_linear

        return fp8_block_linear(x, w, layer.weight_scale_inv, self.block, bias)


def dequantize_blocks(w: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]
                      ) -> torch.Tensor:
    """(N, K) e4m3 times its (N / b0, K / b1) tile scales → float32 (N, K)."""
    rows = scale.repeat_interleave(block[0], 0)[:w.shape[0]]
    return w.float() * rows.repeat_interleave(block[1], 1)[:, :w.shape[1]]


class Fp8Config(QuantizationConfig):
    name = "fp8"
    batch_invariant = False
    runs_on_cuda = True

    def __init__(self, prepack: bool = False, checkpoint: dict[str, Any] | None = None,
                 batch_invariant: bool = False) -> None:
        """checkpoint: a stored fp8 checkpoint's quantization_config (None: quantize float
        weights at load)."""
        self.embedding = UnquantizedLinearMethod(prepack, batch_invariant=batch_invariant)
        self.ignored: tuple[str, ...] = ()
        if checkpoint is None:
            self.method: LinearMethodBase = Fp8LinearMethod()
            return
        self.batch_invariant = batch_invariant  # dense float weights on CPU
        self.method = Fp8BlockCheckpointMethod(checkpoint_block(checkpoint), self.embedding)
        self.ignored = tuple(checkpoint.get("ignored_layers") or
                             checkpoint.get("modules_to_not_convert") or ())

    def linear_method(self, prefix: str) -> LinearMethodBase:
        if any(prefix == p or prefix.startswith(p + ".") for p in self.ignored):
            return self.embedding  # stored in float
        return self.method

    def embedding_method(self, prefix: str) -> LinearMethodBase:
        return self.embedding

    def check_device(self, device: torch.device) -> None:
        if device.type == "cuda" and not isinstance(self.method, Fp8LinearMethod):
            super().check_device(device)  # a stored checkpoint's tiles: the Triton GEMM
        elif device.type == "cuda":
            major, minor = torch.cuda.get_device_capability(device)
            if (major, minor) < (8, 9):
                raise ValueError(f"quantization='fp8' needs fp8 tensor cores (compute "
                                 f"capability 8.9 or later); this GPU is {major}.{minor}")
        elif device.type != "cpu":
            raise ValueError(f"quantization='fp8' runs on CUDA and CPU; device is "
                             f"{device.type}")


def checkpoint_block(cfg: dict[str, Any]) -> tuple[int, int]:
    """A stored fp8 checkpoint's scale tile (weight_block_size); ValueError for what is not
    served (module doc)."""
    block = cfg.get("weight_block_size")
    if str(cfg.get("fmt", "e4m3")).lower() != "e4m3":
        raise ValueError(f"fp8 checkpoint in {cfg.get('fmt')!r}: only e4m3 is served")
    if str(cfg.get("activation_scheme", "dynamic")).lower() != "dynamic":
        raise ValueError("fp8 checkpoint with activation_scheme "
                         f"{cfg.get('activation_scheme')!r}: only dynamic activations are "
                         "served (static input scales are not read)")
    if not block or len(block) != 2 or block[1] % 32:
        raise ValueError(f"fp8 checkpoint with weight_block_size {block!r}: only block-scaled "
                         "fp8 checkpoints (e.g. [128, 128]) are served, not per-tensor scales")
    return int(block[0]), int(block[1])
