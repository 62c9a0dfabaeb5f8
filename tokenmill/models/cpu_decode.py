"""Small-batch decode on CPU float32 without per-layer module dispatch.

A decode step of 1-4 tokens reads each weight once, about 22 ms for SmolLM2 on a 2-core
machine, and the layers' own ops (norms, RoPE, attention over a short context) cost little.
Through the modules, each of the 30 layers also pays about 150 µs of Python: ten module calls,
wrappers, path checks, slicing. This path runs the same decoder layers by calling the same
C++ ops (layers/cpu_ops.py, the paged-attention kernel) directly, from references to each
layer's tensors gathered once. Same ops in the same order as the modules' forward, so the
results are bitwise equal (tests/models/test_cpu_decode.py).

It applies when: 1 <= T <= cpu_ops.SMALL_M tokens, float32 on CPU with the kernels built, no
tensor parallelism, every linear layer kept its dense weight, no per-head q/k norm (Qwen3), and
the attention backend sends every query of the step straight to its kernel (a plain decode
step). Anything else goes through the modules.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.attention import AttentionMetadata
from tokenmill.layers import cpu_ops
from tokenmill.utils.profiling import scope


@dataclass(frozen=True)
class _LayerRefs:
    """What one decoder layer's decode step reads: weights (dense), biases, KV cache."""

    in_norm: torch.Tensor
    post_norm: torch.Tensor
    eps: float
    qkv: tuple[torch.Tensor, torch.Tensor | None]  # (weight (N, K), bias (N,) or None)
    o: tuple[torch.Tensor, torch.Tensor | None]
    gate_up: tuple[torch.Tensor, torch.Tensor | None]
    down: tuple[torch.Tensor, torch.Tensor | None]
    heads: tuple[int, int, int]  # Hq, Hkv, D
    k_cache: torch.Tensor  # (num_blocks, block_size, Hkv, D)
    v_cache: torch.Tensor
    scale: float


class SmallBatchDecode:
    """The layers of a Llama-style model, run for a small decode batch (see module doc)."""

    def __init__(self, layers: nn.ModuleList) -> None:
        self.layers = layers
        self._refs: list[_LayerRefs] | None = None
        self._bound_to: torch.Tensor | None = None  # the KV cache the refs were taken from
        self._op = None

    def applies(self, hidden: torch.Tensor, meta: AttentionMetadata) -> bool:
        T = hidden.shape[0]
        p = meta.paged
        return (0 < T <= cpu_ops.SMALL_M and cpu_ops.fused(hidden) and p is not None
                and p.token_indices.numel() == T and not meta.prefix_cascades
                and self._layer_refs() is not None)

    def run(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
            meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden (T, H) embeddings → (hidden, residual) after the last layer, as the modules'
        loop returns them. cos / sin (T, 1, D) as RotaryEmbedding gives them."""
        ops, attend, p = cpu_ops, self._op, meta.paged
        T = hidden.shape[0]
        residual = None
        for r in self._layer_refs():
            if residual is None:  # the first layer: no residual yet (RMSNorm's plain path)
                residual = hidden
                hidden = F.rms_norm(hidden, r.in_norm.shape, r.in_norm, r.eps)
            else:
                hidden, residual = ops.add_rms_norm(hidden, residual, r.in_norm, r.eps)
            Hq, Hkv, D = r.heads
            qkv = ops.linear_small_m(hidden, *r.qkv).view(T, Hq + 2 * Hkv, D)
            q, k, v = qkv[:, :Hq], qkv[:, Hq:Hq + Hkv], qkv[:, Hq + Hkv:]
            ops.rotary_(q, k, cos, sin)
            with scope("attention"):
                ops.store_kv_(r.k_cache, r.v_cache, k, v, meta.slot_mapping)
                out = attend(q, r.k_cache, r.v_cache, p.block_tables, p.seq_rows,
                             p.start_lens, p.ctx_lens, r.scale)[0].view(T, Hq * D)
            hidden = ops.linear_small_m(out, *r.o)
            hidden, residual = ops.add_rms_norm(hidden, residual, r.post_norm, r.eps)
            hidden = ops.silu_and_mul(ops.linear_small_m(hidden, *r.gate_up))
            hidden = ops.linear_small_m(hidden, *r.down)
        return hidden, residual

    def _layer_refs(self) -> list[_LayerRefs] | None:
        """The layers' references, taken again whenever the KV cache was rebound; None when
        some layer cannot take this path."""
        first = self.layers[0].self_attn.attn
        if self._refs is not None and first.kv_cache is self._bound_to:
            return self._refs
        from tokenmill.attention.cpu_paged import CPUPagedAttention

        self._refs, self._bound_to = None, first.kv_cache
        if first.kv_cache is None or not isinstance(first.backend, CPUPagedAttention):
            return None
        refs = [_refs_of(layer) for layer in self.layers]
        if any(r is None for r in refs):
            return None
        self._op = first.backend._op
        self._refs = refs
        return refs


def _refs_of(layer: nn.Module) -> _LayerRefs | None:
    attn = layer.self_attn
    linears = [attn.qkv_proj, attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj]
    dense = [getattr(lin, "weight", None) for lin in linears]
    if (attn.qk_norm or any(lin.tp.tp_size != 1 for lin in linears)
            or any(w is None or w.dtype != torch.float32 for w in dense)
            or attn.attn.kv_cache.dtype != torch.float32
            or layer.input_layernorm.eps != layer.post_attention_layernorm.eps):
        return None
    kv = attn.attn.kv_cache
    return _LayerRefs(
        in_norm=layer.input_layernorm.weight, post_norm=layer.post_attention_layernorm.weight,
        eps=layer.input_layernorm.eps,
        qkv=(dense[0], attn.qkv_proj.bias), o=(dense[1], attn.o_proj.bias),
        gate_up=(dense[2], layer.mlp.gate_up_proj.bias),
        down=(dense[3], layer.mlp.down_proj.bias),
        heads=(attn.num_heads, attn.num_kv_heads, attn.head_dim),
        k_cache=kv[0], v_cache=kv[1], scale=attn.attn.scale)
