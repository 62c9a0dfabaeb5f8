"""Gemma 2 and Gemma 3 (text): the Llama stack with Gemma's differences, as transformers'
modeling_gemma2.py / modeling_gemma3.py compute them:

- RMSNorm scales by (1 + weight), computed in float32 and cast back after the scaling;
- four norms per layer: the attention's and the MLP's outputs are normed before they join the
  residual (post_attention / post_feedforward), the MLP's input by pre_feedforward;
- the MLP is gated by GELU-tanh (`hidden_activation`, layers/activation.py);
- embeddings are scaled by sqrt(hidden_size) (in the hidden dtype);
- attention scores are scaled by query_pre_attn_scalar ** -0.5; Gemma 2 soft-caps them
  (attn_logit_softcapping) and the final logits (final_logit_softcapping);
- sliding-window and global layers alternate (`layer_types`); Gemma 3 gives the two kinds
  different RoPE bases (layers/rotary.py: one table per variant) and RMS-normalizes each
  head's q and k before RoPE.

Every attention backend computes the windows and soft caps (attention/base.py's FEATURES); the
fused CPU decode call does not run these layers (their norms state a unit offset, their
decoder layer redefines its forward: ops the call does not compute, layers/op_spec.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from tokenmill.attention import AttentionMetadata
from tokenmill.config import layer_sliding_window
from tokenmill.distributed import ParallelState
from tokenmill.layers.attention import Attention
from tokenmill.layers.cuda_ops import cuda_ops
from tokenmill.layers.layernorm import RMSNorm, cuda_rms_norm
from tokenmill.layers.op_spec import OpSpec
from tokenmill.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM
from tokenmill.quantization import QuantizationConfig


class GemmaRMSNorm(RMSNorm):
    """x / rms(x) * (1 + weight) in float32, then cast to x's dtype (Gemma's order)."""

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x32 * (1.0 + self.weight.float())).type_as(x)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if (gpu := cuda_ops(x)) is not None:  # one launch, the same order
            return cuda_rms_norm(gpu, x, self.weight, self.eps, residual, unit_offset=True)
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x

    def op_spec(self) -> OpSpec:
        """RMSNorm scaled by (1 + weight): the op with a unit offset."""
        return OpSpec("rms_norm", frozenset({"unit_offset"}),
                      params={"weight": self.weight, "eps": self.eps})


class GemmaAttention(LlamaAttention):
    def __init__(self, config: Any, tp: ParallelState, quant: QuantizationConfig | None,
                 prefix: str, layer_idx: int, qkv_bias: bool, o_bias: bool,
                 qk_norm: bool) -> None:
        super().__init__(config, tp, quant, prefix, layer_idx, qkv_bias, o_bias)
        self.attn = Attention(self.num_heads, self.num_kv_heads, self.head_dim,
                              scale=config.query_pre_attn_scalar ** -0.5,
                              sliding_window=layer_sliding_window(config, layer_idx),
                              soft_cap=getattr(config, "attn_logit_softcapping", None))
        self.qk_norm = qk_norm  # Gemma 3 norms each head's q and k
        if self.qk_norm:
            self.q_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps)

    def forward(self, position_embeddings: tuple[torch.Tensor, torch.Tensor],
                hidden: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        q, k, v = self.split_heads(self.qkv_proj(hidden))
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        return self.o_proj(self.attn(q, k, v, meta, position_embeddings))  # (T, hidden)


class GemmaDecoderLayer(LlamaDecoderLayer):
    def __init__(self, config: Any, tp: ParallelState, quant: QuantizationConfig | None,
                 prefix: str, layer_idx: int, attention_cls: type[LlamaAttention],
                 mlp_cls: Callable[..., nn.Module], norm_cls: type[RMSNorm],
                 **attn_flags: bool) -> None:
        super().__init__(config, tp, quant, prefix, layer_idx, attention_cls, mlp_cls,
                         norm_cls, **attn_flags)
        self.pre_feedforward_layernorm = norm_cls(config.hidden_size, config.rms_norm_eps)
        self.post_feedforward_layernorm = norm_cls(config.hidden_size, config.rms_norm_eps)

    def forward(self, position_embeddings: tuple[torch.Tensor, torch.Tensor],
                hidden: torch.Tensor, residual: torch.Tensor | None, meta: AttentionMetadata
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """As LlamaDecoderLayer: (hidden, residual) in and out, their sum the layer's
        input / output; each sub-block's output normed before it joins the residual."""
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.post_attention_layernorm(self.self_attn(position_embeddings, hidden, meta))
        hidden, residual = self.pre_feedforward_layernorm(hidden, residual)
        return self.post_feedforward_layernorm(self.mlp(hidden)), residual


def gguf_config_gemma2(meta: Any, tensor: Any, names: set[str]) -> dict[str, Any]:
    """llama.cpp's gemma2: soft caps and the window from metadata; scores scaled by the head
    size (llama.cpp's rule for every size but 27B, whose config says hidden / heads)."""
    return {"query_pre_attn_scalar": meta("attention.key_length"),
            "attn_logit_softcapping": meta("attn_logit_softcapping"),
            "final_logit_softcapping": meta("final_logit_softcapping"),
            "sliding_window": meta("attention.sliding_window")}


def gguf_config_gemma3(meta: Any, tensor: Any, names: set[str]) -> dict[str, Any]:
    """llama.cpp's gemma3: five local layers per global one; local RoPE base 10^4, the file's
    base (and linear scaling) for the global layers."""
    full = {"rope_type": "default", "rope_theta": float(meta("rope.freq_base", 1e6))}
    if meta("rope.scaling.type") == "linear":
        full.update(rope_type="linear", factor=float(meta("rope.scaling.factor")))
    return {"query_pre_attn_scalar": meta("attention.key_length"),
            "sliding_window": meta("attention.sliding_window"), "sliding_window_pattern": 6,
            "rope_parameters": {"sliding_attention": {"rope_type": "default",
                                                      "rope_theta": 10000.0},
                                "full_attention": full}}


class Gemma2ForCausalLM(LlamaForCausalLM):
    attention_cls = GemmaAttention
    layer_cls = GemmaDecoderLayer
    norm_cls = GemmaRMSNorm

    def __init__(self, config: Any, tp: ParallelState = ParallelState(),
                 quant_config: QuantizationConfig | None = None) -> None:
        super().__init__(config, tp, quant_config)
        self.final_logit_softcapping = getattr(config, "final_logit_softcapping", None)

    qk_norm = False

    def _attention_flags(self, config: Any) -> dict[str, bool]:
        bias = bool(getattr(config, "attention_bias", False))
        return {"qkv_bias": bias, "o_bias": bias, "qk_norm": self.qk_norm}

    def _embed_scale(self, config: Any) -> float:
        return config.hidden_size ** 0.5

    def compute_logits(self, hidden: torch.Tensor, logits_indices: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden, logits_indices)  # (N, vocab)
        cap = self.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    """Gemma 3's text model (the checkpoint of a text-only Gemma 3, `Gemma3ForCausalLM`)."""

    qk_norm = True
