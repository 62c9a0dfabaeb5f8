"""Linear layers sharded Megatron-style. Each holds a quantization method object
(tokenmill/quantization/) that creates its weight parameters, processes them after loading
and multiplies; the layer itself only knows how to shard:

- ColumnParallelLinear: output features split across ranks; no communication.
- MergedColumnParallelLinear: several column layers in one GEMM (gate_proj + up_proj).
- QKVParallelLinear: q, k, v projections in one GEMM; heads split across ranks.
- RowParallelLinear: input features split; partial outputs summed with all-reduce.

`weight_loader(param, loaded, shard_id)` takes a full checkpoint tensor (or one shard of a
packed one) and copies this rank's slice into the parameter, whatever the format: each
parameter says which of its dims run along the output and input features and how many stored
units one feature takes there (quantization/base.py `set_weight_attrs`), so a packed int32
word of eight 4-bit values, a per-group scale or a raw GGUF block row narrow the same way.
Parameters are created with torch.empty: the loader fills every one of them or fails. A
parameter with `held_parts` (a dict its method set: GGUF blocks the kernels read as the file
stores them, quantization/gguf.py) is not copied into: each loaded part is kept itself, under
its first row (`fill_span`), and the method builds its kernels from those.
"""

from __future__ import annotations

from fractions import Fraction
from typing import TYPE_CHECKING

import torch
from torch import nn

from tokenmill.distributed import ParallelState
from tokenmill.layers.op_spec import OpSpec
from tokenmill.quantization.base import QuantizationConfig
from tokenmill.quantization.unquantized import UnquantizedConfig

if TYPE_CHECKING:
    from tokenmill.lora.layers import LinearLoRA


def _span(param: nn.Parameter, dim_attr: str, ratio_attr: str, offset: int,
          size: int) -> tuple[int, int, int] | None:
    """(dim, start, length) in stored units of features [offset, offset + size) along the
    param's output or input dim; None when the param does not split along it."""
    dim = getattr(param, dim_attr, None)
    if dim is None:
        return None
    ratio: Fraction = getattr(param, ratio_attr, Fraction(1))
    start, length = offset * ratio, size * ratio
    if start.denominator != 1 or length.denominator != 1:
        raise ValueError(f"a shard of {size} features at {offset} does not fall on whole "
                         f"stored units ({ratio} per feature)")
    return dim, int(start), int(length)


def _copy_checked(dst: torch.Tensor, src: torch.Tensor) -> None:
    if dst.shape != src.shape:
        raise ValueError(f"weight shape mismatch: checkpoint {tuple(src.shape)}, "
                         f"model {tuple(dst.shape)}")
    if dst.dtype != src.dtype and not (dst.is_floating_point() and src.is_floating_point()):
        raise ValueError(f"weight dtype mismatch: checkpoint {src.dtype}, model {dst.dtype}")
    dst.copy_(src)


def fill_span(param: nn.Parameter, src: torch.Tensor, dim: int = 0, start: int = 0,
              length: int | None = None) -> None:
    """Stored units [start, start + length) of `param` along `dim` (all of it when length is
    None) ← src: copied, or, where the parameter holds its parts (module doc), src itself
    kept under `start` when the span runs along rows (its method checks the row width)."""
    held = getattr(param, "held_parts", None)
    if held is not None and dim == 0:
        rows = param.shape[0] - start if length is None else length
        if src.dim() != param.dim() or src.shape[0] != rows:
            raise ValueError(f"weight shape mismatch: checkpoint {tuple(src.shape)}, model "
                             f"{rows} rows of {tuple(param.shape)}")
        held[start] = src
        return
    _copy_checked(param.data if length is None else param.data.narrow(dim, start, length), src)


class LinearBase(nn.Module):
    computes = ("forward",)

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool, tp: ParallelState,
                 quant_config: QuantizationConfig | None, prefix: str) -> None:
        super().__init__()
        self.tp = tp
        self.input_size, self.output_size = input_size, sum(output_sizes)
        self.prefix = prefix
        # LoRA adapters' deltas on this layer's output (lora/layers.py), set by the runner's
        # LoRAManager when the engine serves adapters; None: the weight alone
        self.lora: LinearLoRA | None = None
        self.quant_method = (quant_config or UnquantizedConfig()).linear_method(prefix)
        self.quant_method.create_weights(self, input_size, output_sizes,
                                         torch.get_default_dtype())
        for param in self.parameters(recurse=False):
            param.weight_loader = self.weight_loader
        if bias:
            self.bias = nn.Parameter(torch.empty(self.output_size), requires_grad=False)
            self.bias.output_dim, self.bias.input_dim = 0, None
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor,
                      shard_id: int | str | None = None) -> None:
        fill_span(param, loaded)

    def _load_output_shard(self, param: nn.Parameter, loaded: torch.Tensor, offset: int,
                           size: int, shard_rank: int | None = None) -> None:
        """Features [offset, offset + size) of this rank's output ← slice `shard_rank` (this
        rank's unless given) of `loaded`, which holds one checkpoint tensor's full output
        features."""
        span = _span(param, "output_dim", "output_ratio", offset, size)
        if span is None:  # e.g. GPTQ's g_idx: one for the layer, so every part must agree
            if getattr(param, "loaded_once", False) and not torch.equal(param.data, loaded):
                raise ValueError(f"{self.prefix}: the checkpoint tensors merged here disagree "
                                 f"on a tensor they must share ({tuple(loaded.shape)})")
            _copy_checked(param.data, loaded)
            param.loaded_once = True
            return
        dim, start, length = span
        rank = self.tp.tp_rank if shard_rank is None else shard_rank
        fill_span(param, loaded.narrow(dim, rank * length, length), dim, start, length)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.quant_method.apply(self, x, self.bias)
        return y if self.lora is None else self.lora.add(x, y)

    def op_spec(self) -> OpSpec | None:
        """The product through the method's CPU kernel (None where it has none), then its
        rows' LoRA deltas where the layer has adapter slots ("lora"). A column split needs no
        communication: each rank's rows are its own outputs."""
        kernel = self.quant_method.cpu_kernel(self)
        if kernel is None:
            return None
        variants = {"bias"} if self.bias is not None else set()
        return OpSpec("linear", frozenset(variants | self._lora_variant()),
                      params={"kernel": kernel, "bias": self.bias, "lora": self.lora})

    def _lora_variant(self) -> set[str]:
        return set() if self.lora is None else {"lora"}


class ColumnParallelLinear(LinearBase):
    def __init__(self, input_size: int, output_size: int, bias: bool = False,
                 tp: ParallelState = ParallelState(),
                 quant_config: QuantizationConfig | None = None, prefix: str = "",
                 output_sizes: list[int] | None = None) -> None:
        if output_size % tp.tp_size:
            raise ValueError(f"output size {output_size} not divisible by tp {tp.tp_size}")
        sizes = [s // tp.tp_size for s in (output_sizes or [output_size])]
        super().__init__(input_size, sizes, bias, tp, quant_config, prefix)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor,
                      shard_id: int | str | None = None) -> None:
        self._load_output_shard(param, loaded, 0, self.output_size)


class MergedColumnParallelLinear(ColumnParallelLinear):
    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False,
                 tp: ParallelState = ParallelState(),
                 quant_config: QuantizationConfig | None = None, prefix: str = "") -> None:
        self.output_sizes = output_sizes
        super().__init__(input_size, sum(output_sizes), bias, tp, quant_config, prefix,
                         output_sizes=output_sizes)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor,
                      shard_id: int | str | None = None) -> None:
        assert isinstance(shard_id, int)
        size = self.output_sizes[shard_id] // self.tp.tp_size
        offset = sum(self.output_sizes[:shard_id]) // self.tp.tp_size
        self._load_output_shard(param, loaded, offset, size)


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v in one GEMM. Query heads are split over the TP ranks; KV heads too when
    there are at least as many as ranks, else each rank holds one, replicated over
    tp / num_kv_heads ranks (rank r holds KV head r // replicas, the one its query heads use)."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int,
                 bias: bool = False, tp: ParallelState = ParallelState(),
                 quant_config: QuantizationConfig | None = None, prefix: str = "") -> None:
        check_heads_split(num_heads, num_kv_heads, tp.tp_size)
        self.num_heads = num_heads // tp.tp_size
        self.num_kv_heads = max(1, num_kv_heads // tp.tp_size)
        self.kv_replicas = max(1, tp.tp_size // num_kv_heads)
        self.head_dim = head_dim
        # sizes as if every rank's share were distinct (ColumnParallelLinear divides by tp)
        q, kv = num_heads * head_dim, self.num_kv_heads * tp.tp_size * head_dim
        super().__init__(hidden_size, q + 2 * kv, bias, tp, quant_config, prefix,
                         output_sizes=[q, kv, kv])

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor,
                      shard_id: int | str | None = None) -> None:
        q_size = self.num_heads * self.head_dim
        kv_size = self.num_kv_heads * self.head_dim
        offset, size = {"q": (0, q_size), "k": (q_size, kv_size),
                        "v": (q_size + kv_size, kv_size)}[shard_id]
        rank = self.tp.tp_rank if shard_id == "q" else self.tp.tp_rank // self.kv_replicas
        self._load_output_shard(param, loaded, offset, size, rank)


def check_heads_split(num_heads: int, num_kv_heads: int, tp_size: int) -> None:
    """ValueError unless tp_size ranks can share the attention heads: query heads split evenly,
    KV heads split evenly or (fewer KV heads than ranks) replicated evenly."""
    kv_ok = (num_kv_heads % tp_size == 0 if num_kv_heads >= tp_size
             else tp_size % num_kv_heads == 0)
    if num_heads % tp_size or not kv_ok:
        raise ValueError(f"tensor_parallel_size={tp_size} cannot split {num_heads} attention "
                         f"heads / {num_kv_heads} KV heads: query heads must divide evenly and "
                         "KV heads divide or be replicated evenly")


class RowParallelLinear(LinearBase):
    def __init__(self, input_size: int, output_size: int, bias: bool = False,
                 tp: ParallelState = ParallelState(),
                 quant_config: QuantizationConfig | None = None, prefix: str = "") -> None:
        if input_size % tp.tp_size:
            raise ValueError(f"input size {input_size} not divisible by tp {tp.tp_size}")
        super().__init__(input_size // tp.tp_size, [output_size], bias, tp, quant_config,
                         prefix)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor,
                      shard_id: int | str | None = None) -> None:
        # The bias is added once, after the reduction: every rank holds all of it.
        span = _span(param, "input_dim", "input_ratio", 0, self.input_size)
        if span is None:
            fill_span(param, loaded)
            return
        dim, _, length = span
        fill_span(param, loaded.narrow(dim, self.tp.tp_rank * length, length))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.quant_method.apply(self, x, None)
        if self.lora is not None:  # into the partial sum: the ranks' deltas add up
            y = self.lora.add(x, y)
        y = self.tp.all_reduce(y)
        return y if self.bias is None else y + self.bias

    def op_spec(self) -> OpSpec | None:
        """Split over ranks, the partial outputs are summed: through the shared-memory
        all-reduce ("tp_all_reduce", which a fast path may make itself) or a process group;
        a bias is added after the sum ("bias_after_reduce")."""
        kernel = self.quant_method.cpu_kernel(self)
        if kernel is None:
            return None
        variants = self._lora_variant()
        if self.tp.tp_size > 1:
            comm = self.tp.comm
            shared = comm is not None and comm.world_size == self.tp.tp_size
            variants.add("tp_all_reduce" if shared else "tp_process_group")
            if self.bias is not None:
                variants.add("bias_after_reduce")
        elif self.bias is not None:
            variants.add("bias")
        return OpSpec("linear", frozenset(variants),
                      params={"kernel": kernel, "bias": self.bias, "comm": self.tp.comm,
                              "lora": self.lora})
