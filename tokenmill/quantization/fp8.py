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


class Fp8Config(QuantizationConfig):
    name = "fp8"
    batch_invariant = False
    runs_on_cuda = True

    def __init__(self, prepack: bool = False) -> None:
        self.method = Fp8LinearMethod()
        self.embedding = UnquantizedLinearMethod(prepack, batch_invariant=False)

    def linear_method(self, prefix: str) -> LinearMethodBase:
        return self.method

    def embedding_method(self, prefix: str) -> LinearMethodBase:
        return self.embedding

    def check_device(self, device: torch.device) -> None:
        if device.type == "cuda":
            major, minor = torch.cuda.get_device_capability(device)
            if (major, minor) < (8, 9):
                raise ValueError(f"quantization='fp8' needs fp8 tensor cores (compute "
                                 f"capability 8.9 or later); this GPU is {major}.{minor}")
        elif device.type != "cpu":
            raise ValueError(f"quantization='fp8' runs on CUDA and CPU; device is "
                             f"{device.type}")
