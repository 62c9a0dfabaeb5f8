"""Small-batch decode on CPU float32 without per-layer module dispatch.

A decode step of 1-4 tokens reads each weight once, about 22 ms for SmolLM2 on a 2-core
machine, and the layers' own ops (norms, RoPE, attention over a short context) cost little.
Through the modules, each of the 30 layers also pays about 150 µs of Python: ten module calls,
wrappers, path checks, slicing. This path runs the same decoder layers by calling the same
C++ ops (layers/cpu_ops.py) directly, from references to each layer's tensors gathered once;
attention goes through the layer's own Attention (its bound backend). Same ops in the same
order as the modules' forward, so the results are bitwise equal
(tests/models/test_cpu_decode.py).

It applies to any step of 1 <= T <= cpu_ops.SMALL_M tokens (the modules would take the same
small-M ops), float32 on CPU with the kernels built, when every layer qualifies: no tensor
parallelism, every linear layer kept its dense weight, no per-head q/k norm (Qwen3). Anything
else goes through the modules.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.attention import AttentionMetadata
from tokenmill.layers import cpu_ops
from tokenmill.layers.attention import Attention


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
        self._refs: list[_LayerRefs] | None = None
        self._refs_taken = False  # taken once: None then means some layer cannot take the path

    def applies(self, hidden: torch.Tensor) -> bool:
        return (0 < hidden.shape[0] <= cpu_ops.SMALL_M and cpu_ops.fused(hidden)
                and self._layer_refs() is not None)

    def run(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
            meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden (T, H) embeddings → (hidden, residual) after the last layer, as the modules'
        loop returns them. cos / sin (T, 1, D) as RotaryEmbedding gives them."""
        ops = cpu_ops
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
            hidden = ops.linear_small_m(r.attn.forward(q, k, v, meta), *r.o)
            hidden, residual = ops.add_rms_norm(hidden, residual, r.post_norm, r.eps)
            hidden = ops.silu_and_mul(ops.linear_small_m(hidden, *r.gate_up))
            hidden = ops.linear_small_m(hidden, *r.down)
        return hidden, residual

    def _layer_refs(self) -> list[_LayerRefs] | None:
        """The layers' references (the tensors themselves: loading and prepacking keep them),
        or None when some layer cannot take this path."""
        if not self._refs_taken:
            refs = [_refs_of(layer) for layer in self.layers]
            self._refs = None if any(r is None for r in refs) else refs
            self._refs_taken = True
        return self._refs


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
