"""Dense weights in the model's dtype (float32 on CPU, bf16 / fp16 on CUDA): one method among
the others.

On CPU float32 with the C++ kernels, batch-invariant (the default, EngineConfig.batch_invariant)
every step multiplies through the C++ `linear` op, whose dot kernels sum each row in one order
at every M (csrc/linear_dot.h) and read the dense weight as stored: no second copy. Otherwise
a step of at most cpu_ops.SMALL_M rows (a decode of a few sequences) reads the dense weight
through the same op, which streams it at close to memory bandwidth, and larger steps go
through a oneDNN-prepacked copy (layers/cpu_gemm.py: 180-210 GFLOP/s against 70-140 for
`F.linear`). Keeping both costs the weights' memory twice, so the copy is made only when
`prepack` is on: EngineConfig's "auto" turns it on for models whose float32 weights are at
most PREPACK_AUTO_MAX_BYTES. Without the C++ ops, the dense copy is freed once packed.

`weight_dtype` bfloat16 / float16 (a half-precision checkpoint on CPU: ModelConfig.weight_dtype)
keeps each weight as the checkpoint stores it, no float32 copy: the dot kernels widen it to
float32 in registers (csrc/linear_half.h, exact) at every step size, so results equal the
float32 weights' bit for bit at half the memory. Activations, norms and sums stay float32. A
layer whose input size is not a multiple of 32 keeps float32 weights.

`matmul_dtype` bfloat16 (ModelConfig.matmul_dtype: by default where the CPU has AVX512-BF16)
multiplies those bfloat16 weights in bfloat16 instead: each step's activations rounded to
bf16, vdpbf16ps's products, float32 sums (csrc/linear_bf16.h, batch-invariant; emulated
bit for bit elsewhere): about 2x the widened kernels' speed in batched steps, lossy against
float32 by the activations' rounding (tests/quantization/test_half_weights.py states it). Where
the CPU has AMX-BF16 those weights are packed once, in place, into AMX tiles' layout (kind
BF16_TILES, csrc/linear_bf16_amx.h; N a multiple of 16, else kind BF16_PRODUCTS stays): the
parameter then holds (N / 16, K / 2, 16, 2), a tied table is looked up from it (`embed`), and
`dense_weight` gives W back for the rare float path.

Half-precision weights on CPU can be used in place: the kernels read them as the checkpoint
stores them, so each loaded part is kept itself (`held_parts`, layers/linear.py `fill_span`),
uncopied where the loader hands over views of the file's map (model_loader/
safetensors_loader.py; a checkpoint large against memory: model_loader/loader.py
SAFETENSORS_IN_PLACE_SHARE; below it the loader drops `held_parts` and copies, as before).
A layer of one part holds it as its `weight`; a merged layer (qkv, gate_up) holds its parts as
`weight_0`, `weight_1`, ... and multiplies them side by side (CPULinearKernel.PARTS, the same
kernel per part: the same bits as one merged weight). A weight packed for AMX, or a CPU
without the C++ kernels, joins its parts into one `weight`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.layers import cpu_ops
from tokenmill.layers.cpu_gemm import onednn_available, packed_linear, prepack
from tokenmill.quantization.base import (
    CPULinearKernel,
    LinearMethodBase,
    QuantizationConfig,
    merged_kernel,
    new_param,
    replace_param,
)

# "auto" prepacks models up to this many bytes of float32 weights (1.3B parameters): their
# second copy fits beside them on the 24 GiB development machines with room for the KV cache.
PREPACK_AUTO_MAX_BYTES = 5 << 30


_HALF_KINDS = {torch.bfloat16: CPULinearKernel.BF16, torch.float16: CPULinearKernel.F16}


class UnquantizedLinearMethod(LinearMethodBase):
    def __init__(self, prepack: bool = True, batch_invariant: bool = True,
                 weight_dtype: torch.dtype | None = None,
                 matmul_dtype: torch.dtype | None = None) -> None:
        if weight_dtype is not None and weight_dtype not in _HALF_KINDS:
            raise ValueError(f"weight_dtype must be bfloat16 or float16, got {weight_dtype}")
        if matmul_dtype not in (None, torch.bfloat16) or \
                (matmul_dtype is not None and weight_dtype != matmul_dtype):
            raise ValueError("matmul_dtype bfloat16 applies to bfloat16 weights; got weights "
                             f"{weight_dtype}, matmul {matmul_dtype}")
        self.batch_invariant = batch_invariant
        self.prepack = prepack and not batch_invariant  # the invariant kernels read W itself
        self.weight_dtype = weight_dtype
        self.matmul_dtype = matmul_dtype

    def create_weights(self, layer: nn.Module, input_size: int, output_sizes: list[int],
                       dtype: torch.dtype) -> None:
        if self.weight_dtype is not None and input_size % 32 == 0:
            dtype = self.weight_dtype  # read in blocks of 32 by the kernels
        layer.weight = new_param((sum(output_sizes), input_size), dtype, output_dim=0,
                                 input_dim=1)
        layer.packed_weight = None
        if dtype == self.weight_dtype and layer.weight.is_cpu:
            # read as stored: each loaded part kept as it is (module doc); the merged
            # parameter is never written, so its pages are never touched
            layer.weight.held_parts = {}

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        _take_held_parts(layer, self.matmul_dtype)
        if _weight_parts(layer) is not None:
            return  # half-precision parts the kernels read as stored
        w = layer.weight
        # runs_gemm False: an embedding table only looked up (layers/vocab_embedding.py).
        runs_gemm = getattr(layer, "runs_gemm", True)
        if w.dtype in _HALF_KINDS and w.is_cpu:
            if runs_gemm and _packs_for_amx(w, self.matmul_dtype):
                w.data = cpu_ops.bf16_tiles(w.data)  # in place of W: no second copy
            return  # the kernels read it as stored
        if self.prepack and runs_gemm and \
                onednn_available(w.device, w.dtype):
            layer.packed_weight = prepack(w)
            if not cpu_ops.ops_available() and not getattr(layer, "looks_up_rows", False):
                del layer._parameters["weight"]  # nothing reads the dense copy: free it

    def cpu_kernel(self, layer: nn.Module) -> CPULinearKernel | None:
        parts = _weight_parts(layer)
        if parts is None:
            return self._kernel_of(getattr(layer, "weight", None))
        kernels = [k for w in parts if (k := self._kernel_of(w)) is not None]
        return merged_kernel(kernels, batch_invariant=self.batch_invariant) \
            if len(kernels) == len(parts) else None

    def _kernel_of(self, w: torch.Tensor | None) -> CPULinearKernel | None:
        if w is None or not w.is_cpu:
            return None
        if w.dtype == self.matmul_dtype:  # bfloat16 products (one kernel at every M)
            kind = CPULinearKernel.BF16_TILES if w.dim() == 4 else CPULinearKernel.BF16_PRODUCTS
            return CPULinearKernel(kind, 0, (w,))
        if w.dtype in _HALF_KINDS and self.weight_dtype is not None:
            return CPULinearKernel(_HALF_KINDS[w.dtype], 0, (w,),
                                   batch_invariant=self.batch_invariant)
        if w.dtype != torch.float32:
            return None
        return CPULinearKernel(CPULinearKernel.DENSE, 0, (w,),
                               batch_invariant=self.batch_invariant,
                               max_rows=None if self.batch_invariant else cpu_ops.SMALL_M)

    def apply(self, layer: nn.Module, x: torch.Tensor,
              bias: torch.Tensor | None = None) -> torch.Tensor:
        kernel = self.cpu_kernel(layer) if x.shape[0] > 0 and cpu_ops.fused(x) else None
        if kernel is not None and kernel.runs(x.shape[0]):
            return cpu_ops.linear(x, kernel, bias)
        if layer.packed_weight is not None:
            return packed_linear(x, layer.packed_weight, bias)
        parts = _weight_parts(layer)
        w = dense_weight(layer.weight) if parts is None else torch.cat(parts)
        return F.linear(x, w, bias)

    def embed(self, layer: nn.Module, ids: torch.Tensor) -> torch.Tensor:
        w = layer.weight
        rows = tile_rows(w, ids) if w.dim() == 4 else F.embedding(ids, w)
        return rows.float() if self.weight_dtype is not None else rows  # widening is exact


def _take_held_parts(layer: nn.Module, matmul_dtype: torch.dtype | None) -> None:
    """The loaded parts of a weight that held them (create_weights) in place of the merged
    parameter: one part as `weight`, several as `weight_0`, `weight_1`, ... (joined into one
    `weight` where it will be packed for AMX or no C++ kernel reads parts). A weight that was
    written instead (a dummy load, row-parallel shards) stays as it is."""
    w = layer.weight
    held = getattr(w, "held_parts", None)
    if not held:
        return
    parts, row = [], 0
    for start in sorted(held):
        part = held[start]
        if start != row or part.dim() != 2 or part.shape[1] != w.shape[1]:
            raise ValueError(f"weight parts do not tile {tuple(w.shape)}: "
                             f"{tuple(part.shape)} at row {start} (expected row {row})")
        parts.append(part.to(w.dtype).contiguous())  # (as loaded: a no-op)
        row += part.shape[0]
    if row != w.shape[0]:
        raise ValueError(f"weight parts cover {row} of {w.shape[0]} rows")
    if len(parts) == 1 or _packs_for_amx(w, matmul_dtype) or not cpu_ops.ops_available():
        replace_param(layer, "weight", parts[0] if len(parts) == 1 else torch.cat(parts))
        return
    replace_param(layer, "weight", None)
    for p, part in enumerate(parts):
        replace_param(layer, f"weight_{p}", part)


def _weight_parts(layer: nn.Module) -> list[torch.Tensor] | None:
    """A merged layer's weight parts (_take_held_parts), in row order; None: one `weight`."""
    if "weight" in layer._parameters or "weight_0" not in layer._parameters:
        return None
    parts = []
    while (part := layer._parameters.get(f"weight_{len(parts)}")) is not None:
        parts.append(part)
    return parts


def _packs_for_amx(w: torch.Tensor, matmul_dtype: torch.dtype | None) -> bool:
    """Whether a weight multiplied in bfloat16 is packed for AMX tiles (kind BF16_TILES): the
    CPU has them (and the switch is on: cpu_ops.bf16_products_amx) and its shape tiles whole
    (N a multiple of 16, K of 32). Others keep kind BF16_PRODUCTS (vdpbf16ps)."""
    return (w.dtype == matmul_dtype == torch.bfloat16 and w.dim() == 2
            and w.shape[0] % 16 == 0 and w.shape[1] % 32 == 0 and cpu_ops.ops_available()
            and cpu_ops.bf16_products_amx())


# Weights packed for AMX tiles hold W (N, K) as (N / 16, K / 2, 16, 2): row 16 g + j's pair
# of k p at [g, p, j] (csrc/linear_bf16_amx.h). The two readers of that layout here:

def dense_weight(w: torch.Tensor) -> torch.Tensor:
    """W (N, K) of a weight as the layer holds it: AMX tiles unpacked (a copy), any other as
    is."""
    if w.dim() != 4:
        return w
    return w.permute(0, 2, 1, 3).reshape(w.shape[0] * 16, w.shape[1] * 2)


def tile_rows(w: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Rows `ids` (any shape) of W packed for AMX tiles, as W's rows: (*ids.shape, K) (a tied
    table's lookups)."""
    flat = ids.reshape(-1)
    return w[flat // 16, :, flat % 16, :].reshape(*ids.shape, 2 * w.shape[1])


class UnquantizedConfig(QuantizationConfig):
    name = "none"

    def __init__(self, prepack: bool = True, batch_invariant: bool = True,
                 weight_dtype: torch.dtype | None = None,
                 matmul_dtype: torch.dtype | None = None) -> None:
        self.batch_invariant = batch_invariant
        self.method = UnquantizedLinearMethod(prepack, batch_invariant, weight_dtype,
                                              matmul_dtype)

    def linear_method(self, prefix: str) -> LinearMethodBase:
        return self.method

    def check_device(self, device: torch.device) -> None:
        pass  # runs everywhere torch does
