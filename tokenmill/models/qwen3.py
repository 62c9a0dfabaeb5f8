"""Qwen3: the Llama block with RMSNorm on each head's q and k before RoPE, biases per config."""

from __future__ import annotations

from typing import Any

import torch

from tokenmill.attention import AttentionMetadata
from tokenmill.distributed import ParallelState
from tokenmill.layers.layernorm import RMSNorm
from tokenmill.layers.op_spec import OpSpec
from tokenmill.models.llama import LlamaAttention, LlamaForCausalLM, with_qk_norms
from tokenmill.quantization import QuantizationConfig


class Qwen3Attention(LlamaAttention):
    computes = ("forward", "split_heads")

    def __init__(self, config: Any, tp: ParallelState, quant: QuantizationConfig | None,
                 prefix: str, layer_idx: int, qkv_bias: bool, o_bias: bool) -> None:
        super().__init__(config, tp, quant, prefix, layer_idx, qkv_bias, o_bias)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)

    def forward(self, position_embeddings: tuple[torch.Tensor, torch.Tensor],
                hidden: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        q, k, v = self.split_heads(self.qkv_proj(hidden))
        q, k = self.q_norm(q), self.k_norm(k)  # then RoPE, in the attention layer
        return self.o_proj(self.attn(q, k, v, meta, position_embeddings))  # (T, hidden)

    def op_spec(self) -> OpSpec | None:
        """Llama's attention with an RMSNorm over each head's q and k before RoPE ("qk_norm")."""
        return with_qk_norms(self, {"qk_norm"})


class Qwen3ForCausalLM(LlamaForCausalLM):
    attention_cls = Qwen3Attention
