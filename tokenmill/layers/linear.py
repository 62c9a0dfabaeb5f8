"""Linear layers sharded Megatron-style, each with a `weight_loader` that takes a full checkpoint
tensor (or one shard of a packed one) and copies this rank's slice into the parameter.

- ColumnParallelLinear: output features split across ranks; no communication.
- MergedColumnParallelLinear: several column layers in one GEMM (gate_proj + up_proj).
- QKVParallelLinear: q, k, v projections in one GEMM; heads split across ranks.
- RowParallelLinear: input features split; partial outputs summed with all-reduce.

Parameters are created with torch.empty: the loader fills every one of them or fails. After
loading, `prepack()` may add a oneDNN-packed copy of the weight (layers/cpu_gemm.py) for GEMMs;
the loaders must not run after that. On CPU float32 a step of at most SMALL_M tokens (a decode
of a few sequences) reads the dense weight through `cpu_ops.linear_small_m` instead, which
streams it at close to memory bandwidth: the dense copy is kept for it when the C++ ops are
available (the price is the weights' memory twice), and freed otherwise.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.distributed import ParallelState
from tokenmill.layers import cpu_ops
from tokenmill.layers.cpu_gemm import packed_linear, prepack


class LinearBase(nn.Module):
    def __init__(self, input_size: int, output_size: int, bias: bool, tp: ParallelState) -> None:
        super().__init__()
        self.tp = tp
        self.input_size, self.output_size = input_size, output_size
        self.weight = nn.Parameter(torch.empty(output_size, input_size), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        if bias:
            self.bias = nn.Parameter(torch.empty(output_size), requires_grad=False)
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)
        self.packed_weight: torch.Tensor | None = None

    def prepack(self) -> None:
        """Add a oneDNN-packed copy of the weight for GEMMs (CPU float32 only)."""
        if self.packed_weight is None:
            packed = prepack(self.weight)
            if not cpu_ops.ops_available():
                del self.weight  # the small-M kernel will not read the dense copy: free it
            self.packed_weight = packed

    def _matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        weight = getattr(self, "weight", None)  # None once prepack() freed it
        if cpu_ops.takes_small_m(x, weight):
            return cpu_ops.linear_small_m(x, weight, bias)
        if self.packed_weight is not None:
            return packed_linear(x, self.packed_weight, bias)
        return F.linear(x, self.weight, bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor,
                      shard_id: int | str | None = None) -> None:
        _copy_checked(param.data, loaded)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._matmul(x, self.bias)


def _copy_checked(dst: torch.Tensor, src: torch.Tensor) -> None:
    if dst.shape != src.shape:
        raise ValueError(f"weight shape mismatch: checkpoint {tuple(src.shape)}, "
                         f"model {tuple(dst.shape)}")
    dst.copy_(src)


class ColumnParallelLinear(LinearBase):
    def __init__(self, input_size: int, output_size: int, bias: bool = False,
                 tp: ParallelState = ParallelState()) -> None:
        if output_size % tp.tp_size:
            raise ValueError(f"output size {output_size} not divisible by tp {tp.tp_size}")
        super().__init__(input_size, output_size // tp.tp_size, bias, tp)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor,
                      shard_id: int | str | None = None) -> None:
        n = param.shape[0]
        _copy_checked(param.data, loaded.narrow(0, self.tp.tp_rank * n, n))


class MergedColumnParallelLinear(ColumnParallelLinear):
    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False,
                 tp: ParallelState = ParallelState()) -> None:
        self.output_sizes = output_sizes
        super().__init__(input_size, sum(output_sizes), bias, tp)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor,
                      shard_id: int | str | None = None) -> None:
        assert isinstance(shard_id, int)
        size = self.output_sizes[shard_id] // self.tp.tp_size
        offset = sum(self.output_sizes[:shard_id]) // self.tp.tp_size
        _copy_checked(param.data.narrow(0, offset, size),
                      loaded.narrow(0, self.tp.tp_rank * size, size))


class QKVParallelLinear(ColumnParallelLinear):
    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int,
                 bias: bool = False, tp: ParallelState = ParallelState()) -> None:
        if num_heads % tp.tp_size or num_kv_heads % tp.tp_size:
            raise ValueError(f"{num_heads} heads / {num_kv_heads} KV heads cannot be split "
                             f"over tp={tp.tp_size}")
        self.num_heads = num_heads // tp.tp_size
        self.num_kv_heads = num_kv_heads // tp.tp_size
        self.head_dim = head_dim
        super().__init__(hidden_size, (num_heads + 2 * num_kv_heads) * head_dim, bias, tp)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor,
                      shard_id: int | str | None = None) -> None:
        q_size = self.num_heads * self.head_dim
        kv_size = self.num_kv_heads * self.head_dim
        offset, size = {"q": (0, q_size), "k": (q_size, kv_size),
                        "v": (q_size + kv_size, kv_size)}[shard_id]
        _copy_checked(param.data.narrow(0, offset, size),
                      loaded.narrow(0, self.tp.tp_rank * size, size))


class RowParallelLinear(LinearBase):
    def __init__(self, input_size: int, output_size: int, bias: bool = False,
                 tp: ParallelState = ParallelState()) -> None:
        if input_size % tp.tp_size:
            raise ValueError(f"input size {input_size} not divisible by tp {tp.tp_size}")
        super().__init__(input_size // tp.tp_size, output_size, bias, tp)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor,
                      shard_id: int | str | None = None) -> None:
        if param.dim() == 1:  # bias: added once, after the reduction
            _copy_checked(param.data, loaded)
            return
        n = param.shape[1]
        _copy_checked(param.data, loaded.narrow(1, self.tp.tp_rank * n, n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.tp.all_reduce(self._matmul(x, None))
        return y if self.bias is None else y + self.bias
