"""Small-batch decode on CPU: all decoder layers of a 1-4 token step in one C++ call.

A decode step of a few tokens reads each weight once (about 22 ms for SmolLM2 in float32 on a
2-core machine), and the layers' own ops cost little; through the modules, each of the 30
layers also pays about 150 µs of Python (ten module calls, wrappers, checks). The C++ call
(csrc/decode_layers_cpu.cpp) runs the same ops in the same order with the same kernels and
releases the GIL while it runs; each linear layer's weight comes from its quantization
method object (`cpu_kernel`: dense float32, Q8_0, 4-bit blocks), so every weight format the
methods know takes this path and none is written twice. Results are bitwise equal to the
modules' forward (tests/models/test_cpu_decode.py).

It is opt-in by an allow-list: it runs only layers whose every part is exactly one of the
types `_allowed()` names (a subclass, such as Qwen3's attention with its q/k norms, is another
model and goes through the modules), unsplit or split over tensor-parallel ranks that share
the shared-memory all-reduce (the call then sums the row-parallel outputs itself, between the
same ops, so ranks stay bitwise equal to their modules), float32 activations on CPU,
a KV cache in a format the kernel reads (`KERNEL_KV_DTYPES`: float32, int8, fp8), causal
attention without a soft cap, with one sliding window or none for all layers (the window
moves each query's first key, as the attention backend does) and RoPE over whole heads, every
linear layer's method giving a CPU kernel, and a step whose every query goes to the CPU
paged-attention kernel (the attention backend says so through `fused_decode_queries`;
backends without that kernel never do). Anything else runs the
modules, whose layers call the same kernels through the same method objects.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from tokenmill.attention import AttentionMetadata
from tokenmill.distributed.shm_all_reduce import ShmAllReduce
from tokenmill.layers import cpu_ops
from tokenmill.layers.attention import Attention
from tokenmill.layers.layernorm import RMSNorm
from tokenmill.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from tokenmill.utils.cpp_extension import load_cpu_extension
from tokenmill.utils.profiling import scope

# A linear layer as decode_layers takes it: (kind, group, tensors, int8 activations, input
# scale or None, bias or None).
LinearArgs = tuple[int, int, list[torch.Tensor], bool, torch.Tensor | None,
                   torch.Tensor | None]
# KV cache storage the kernels read and write (csrc/kv_formats.h), the allow-list.
KERNEL_KV_DTYPES = tuple(d for d in (torch.float32, torch.int8,
                                     getattr(torch, "float8_e4m3fn", None)) if d is not None)


@functools.cache
def _decode_layers_op() -> Any | None:
    module = load_cpu_extension("decode_layers_cpu")
    return None if module is None else module.decode_layers


def _allowed() -> dict[str, type]:
    """The exact module types decode_layers implements (imported late: models import this)."""
    from tokenmill.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaMLP

    return {"layer": LlamaDecoderLayer, "self_attn": LlamaAttention, "mlp": LlamaMLP,
            "input_layernorm": RMSNorm, "post_attention_layernorm": RMSNorm,
            "qkv_proj": QKVParallelLinear, "o_proj": RowParallelLinear,
            "gate_up_proj": MergedColumnParallelLinear, "down_proj": RowParallelLinear}


@dataclass(frozen=True)
class _Plan:
    """What decode_layers reads, gathered once (after the runner bound the KV caches)."""

    norms: list[torch.Tensor]  # in_norm, post_norm per layer
    linears: list[LinearArgs]  # qkv, o, gate_up, down per layer
    attns: list[Attention]
    heads: tuple[int, int, int]  # Hq, Hkv, D
    eps: float
    scale: float
    comm: ShmAllReduce | None  # tensor parallelism: the all-reduce the call makes itself
    window: int | None  # every layer's sliding window (Mistral), or None


class SmallBatchDecode:
    """The decoder layers of a Llama model, run for a small decode batch (see module doc)."""

    def __init__(self, layers: nn.ModuleList, full_rotary: bool = True) -> None:
        self.layers = layers
        self.full_rotary = full_rotary  # RoPE over whole heads (the call rotates them all)
        self.enabled = True  # off: the modules (benchmarks/decode_paths.py compares them)

    def applies(self, hidden: torch.Tensor, meta: AttentionMetadata) -> bool:
        if not (self.enabled and 0 < hidden.shape[0] <= cpu_ops.SMALL_M
                and cpu_ops.fused(hidden) and self._plan is not None):
            return False
        return self._queries(meta, hidden.shape[0]) is not None

    def _queries(self, meta: AttentionMetadata, num_tokens: int) -> Any | None:
        """The attention kernel's queries for this step, when its backend lets the fused call
        run the kernel (every query of a plain decode step goes to it), else None."""
        return self._plan.attns[0].backend.fused_decode_queries(meta, num_tokens)

    def run(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
            meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden (T, H) embeddings → (hidden, residual) after the last layer, as the modules'
        loop returns them. cos / sin (T, 1, D) as RotaryEmbedding gives them. Only after
        `applies` said True."""
        plan = self._plan
        p = self._queries(meta, hidden.shape[0])
        comm = plan.comm
        shm = (None, 0, 1, 0, 0.0) if comm is None else comm.kernel_args()
        with scope("tokenmill::decode_layers"):
            hidden, residual, seq = _decode_layers_op()(
                hidden, plan.norms, plan.linears, [a.kv_cache for a in plan.attns],
                [a.kv_scales for a in plan.attns], plan.attns[0].key_rotation, cos, sin,
                meta.slot_mapping, p.block_tables, p.seq_rows, p.first_keys(plan.window),
                p.ctx_lens,
                *plan.heads, plan.eps, plan.scale, *shm[:4],
                0 if comm is None else comm.seq, shm[4])
        if comm is not None:
            comm.seq = seq
        return hidden, residual

    @functools.cached_property
    def _plan(self) -> _Plan | None:
        """Taken at the first step (weights processed, huge pages moved, caches bound); None,
        cached too, when some layer is not on the allow-list."""
        if _decode_layers_op() is None or not self.layers or not self.full_rotary:
            return None
        parts = [_parts_of(layer) for layer in self.layers]
        if any(p is None for p in parts):
            return None
        first = self.layers[0].self_attn
        heads = (first.num_heads, first.num_kv_heads, first.head_dim)
        eps = self.layers[0].input_layernorm.eps
        scale = first.attn.scale
        for layer in self.layers:  # decode_layers takes one of each for all layers
            a = layer.self_attn
            if ((a.num_heads, a.num_kv_heads, a.head_dim) != heads or a.attn.scale != scale
                    or {layer.input_layernorm.eps, layer.post_attention_layernorm.eps} != {eps}
                    or a.attn.backend is not first.attn.backend
                    or a.attn.key_rotation is not first.attn.key_rotation
                    or a.attn.kv_cache.dtype not in KERNEL_KV_DTYPES
                    # causal attention, one window (or none) for all layers, no soft cap
                    or a.attn.sliding_window != first.attn.sliding_window
                    or a.attn.soft_cap is not None):
                return None
        return _Plan(norms=[t for p in parts for t in p[0]],
                     linears=[lin for p in parts for lin in p[1]],
                     attns=[layer.self_attn.attn for layer in self.layers],
                     heads=heads, eps=eps, scale=scale, comm=first.o_proj.tp.comm,
                     window=first.attn.sliding_window)


def _split_supported(lin: nn.Module) -> bool:
    """Whether the call computes this layer as its module does under its tensor parallelism:
    unsplit, or split with the shared-memory all-reduce (which the call makes itself) and, for
    a row-parallel layer, no bias (the module adds it after the reduction)."""
    tp = lin.tp
    if tp.tp_size == 1:
        return True
    if tp.comm is None or tp.comm.world_size != tp.tp_size:
        return False
    return not isinstance(lin, RowParallelLinear) or lin.bias is None


def _parts_of(layer: nn.Module) -> tuple[list[torch.Tensor], list[LinearArgs]] | None:
    """The layer's norms and linear kernels, or None unless every part is allow-listed."""
    allowed = _allowed()
    attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    modules = {"layer": layer, "self_attn": attn, "mlp": mlp,
               "input_layernorm": getattr(layer, "input_layernorm", None),
               "post_attention_layernorm": getattr(layer, "post_attention_layernorm", None),
               "qkv_proj": getattr(attn, "qkv_proj", None),
               "o_proj": getattr(attn, "o_proj", None),
               "gate_up_proj": getattr(mlp, "gate_up_proj", None),
               "down_proj": getattr(mlp, "down_proj", None)}
    if any(type(m) is not allowed[name] for name, m in modules.items()):
        return None
    linears: list[LinearArgs] = []
    for lin in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj):
        kernel = lin.quant_method.cpu_kernel(lin)
        if kernel is None or not _split_supported(lin):
            return None
        linears.append((*kernel.as_args(), lin.bias))
    return [layer.input_layernorm.weight, layer.post_attention_layernorm.weight], linears
