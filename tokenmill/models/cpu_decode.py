"""Small-batch decode on CPU float32 without per-layer module dispatch.

A decode step of 1-4 tokens reads each weight once, about 22 ms for SmolLM2 on a 2-core
machine, and the layers' own ops (norms, RoPE, attention over a short context) cost little.
Through the modules, each of the 30 layers also pays about 150 µs of Python: ten module calls,
wrappers, path checks, slicing. This path runs the same decoder layers with the same C++ ops
(layers/cpu_ops.py), from references to each layer's tensors gathered once, in one of two ways:
- fused: when every query of the step goes to the CPU paged-attention kernel (a plain decode
  step on the CPU backend), all layers run in one C++ call (csrc/decode_layers_cpu.cpp),
  which calls the same kernels in the same order and releases the GIL while it runs;
- otherwise a Python loop over the layers calls the ops directly, with attention through the
  layer's own Attention (its bound backend: cascades, prefill chunks, the PyTorch backend).
Both give results bitwise equal to the modules' forward (tests/models/test_cpu_decode.py).

It applies to any step of 1 <= T <= cpu_ops.SMALL_M tokens (the modules would take the same
small-M ops), float32 on CPU with the kernels built, when every layer qualifies: no tensor
parallelism, every linear layer kept its dense weight, no per-head q/k norm (Qwen3). Anything
else goes through the modules.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.attention import AttentionMetadata
from tokenmill.attention.cpu_paged import CPUPagedAttention
from tokenmill.layers import cpu_ops
from tokenmill.layers.attention import Attention
from tokenmill.utils.cpp_extension import load_cpu_extension
from tokenmill.utils.profiling import scope


@functools.cache
def _decode_layers_op() -> Any | None:
    module = load_cpu_extension("decode_layers_cpu")
    return None if module is None else module.decode_layers


@dataclass(frozen=True)
class _LayerRefs:
    """What one decoder layer's decode step reads: weights (dense), biases, its attention."""

    in_norm: torch.Tensor
    post_norm: torch.Tensor
    eps: float
    qkv: tuple[torch.Tensor, torch.Tensor | None]  # (weight (N, K), bias (N,) or None)
    o: tuple[torch.Tensor, torch.Tensor | None]
    gate_up: tuple[torch.Tensor, torch.Tensor | None]
    down: tuple[torch.Tensor, torch.Tensor | None]
    heads: tuple[int, int, int]  # Hq, Hkv, D
    attn: Attention


class SmallBatchDecode:
    """The layers of a Llama-style model, run for a small decode batch (see module doc)."""

    def __init__(self, layers: nn.ModuleList) -> None:
        self.layers = layers
        # Switches for comparing the ways (benchmarks/decode_paths.py): off = the modules.
        self.enabled = True
        self.fused = True

    def applies(self, hidden: torch.Tensor) -> bool:
        return (self.enabled and 0 < hidden.shape[0] <= cpu_ops.SMALL_M and cpu_ops.fused(hidden)
                and self._layer_refs is not None)

    def run(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
            meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden (T, H) embeddings → (hidden, residual) after the last layer, as the modules'
        loop returns them. cos / sin (T, 1, D) as RotaryEmbedding gives them."""
        refs = self._layer_refs
        p = CPUPagedAttention.kernel_only(meta, hidden.shape[0])
        op = _decode_layers_op() if p is not None and self.fused else None
        flat = self._flat_refs if op is not None else None
        if flat is not None and all(isinstance(r.attn.backend, CPUPagedAttention)
                                    and r.attn.kv_cache.dtype == torch.float32 for r in refs):
            weights, biases = flat
            r0 = refs[0]
            with scope("tokenmill::decode_layers"):
                hidden, residual = op(hidden, weights, biases, [r.attn.kv_cache for r in refs],
                                      cos, sin, meta.slot_mapping, p.block_tables,
                                      p.seq_rows, p.start_lens, p.ctx_lens, *r0.heads,
                                      r0.eps, r0.attn.scale)
            return hidden, residual
        ops = cpu_ops
        T = hidden.shape[0]
        residual = None
        for r in refs:
            if residual is None:  # the first layer: no residual yet (RMSNorm's plain path)
                residual = hidden
                hidden = F.rms_norm(hidden, r.in_norm.shape, r.in_norm, r.eps)
            else:
                hidden, residual = ops.add_rms_norm(hidden, residual, r.in_norm, r.eps)
            Hq, Hkv, D = r.heads
            qkv = ops.linear_small_m(hidden, *r.qkv).view(T, Hq + 2 * Hkv, D)
            q, k, v = qkv[:, :Hq], qkv[:, Hq:Hq + Hkv], qkv[:, Hq + Hkv:]
            ops.rotary_(q, k, cos, sin)
            hidden = ops.linear_small_m(r.attn.forward(q, k, v, meta), *r.o)
            hidden, residual = ops.add_rms_norm(hidden, residual, r.post_norm, r.eps)
            hidden = ops.silu_and_mul(ops.linear_small_m(hidden, *r.gate_up))
            hidden = ops.linear_small_m(hidden, *r.down)
        return hidden, residual

    # Both taken once, at the first step (after the runner bound each layer's KV cache); None
    # is cached too: the layers cannot take the path, or not in one C++ call.
    @functools.cached_property
    def _flat_refs(self) -> tuple[list[torch.Tensor], list[torch.Tensor | None]] | None:
        """The layers' weights (6 per layer) and biases (4 per layer) as decode_layers takes
        them; None if the layers differ in heads, eps or scale (it takes one of each)."""
        refs = self._layer_refs
        r0 = refs[0]
        if any((r.heads, r.eps, r.attn.scale) != (r0.heads, r0.eps, r0.attn.scale)
               for r in refs):
            return None
        return ([t for r in refs for t in (r.in_norm, r.post_norm, r.qkv[0], r.o[0],
                                           r.gate_up[0], r.down[0])],
                [b for r in refs for b in (r.qkv[1], r.o[1], r.gate_up[1], r.down[1])])

    @functools.cached_property
    def _layer_refs(self) -> list[_LayerRefs] | None:
        """The layers' references (the tensors themselves: loading and prepacking keep them),
        or None when some layer cannot take this path."""
        refs = [_refs_of(layer) for layer in self.layers]
        return None if any(r is None for r in refs) else refs


def _refs_of(layer: nn.Module) -> _LayerRefs | None:
    attn = layer.self_attn
    linears = [attn.qkv_proj, attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj]
    dense = [getattr(lin, "weight", None) for lin in linears]
    if (attn.qk_norm or any(lin.tp.tp_size != 1 for lin in linears)
            or any(w is None or w.dtype != torch.float32 for w in dense)
            or layer.input_layernorm.eps != layer.post_attention_layernorm.eps):
        return None
    return _LayerRefs(
        in_norm=layer.input_layernorm.weight, post_norm=layer.post_attention_layernorm.weight,
        eps=layer.input_layernorm.eps,
        qkv=(dense[0], attn.qkv_proj.bias), o=(dense[1], attn.o_proj.bias),
        gate_up=(dense[2], layer.mlp.gate_up_proj.bias),
        down=(dense[3], layer.mlp.down_proj.bias),
        heads=(attn.num_heads, attn.num_kv_heads, attn.head_dim), attn=attn.attn)
