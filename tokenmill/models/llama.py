"""Llama family (Llama 2/3, SmolLM2, Mistral without sliding window) and Qwen2 (q/k/v bias).

Reads like transformers' modeling_llama.py, with two serving changes: q/k/v and gate/up are
merged into one GEMM each (`packed_modules_mapping` tells the loader how checkpoint names map
onto them), and the input is one flat batch of T tokens from many sequences, with positions
and AttentionMetadata passed explicitly.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from tokenmill.attention import AttentionMetadata
from tokenmill.distributed import ParallelState
from tokenmill.layers.activation import SiluAndMul
from tokenmill.layers.attention import Attention
from tokenmill.layers.layernorm import RMSNorm
from tokenmill.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from tokenmill.layers.rotary import RotaryEmbedding, apply_rotary
from tokenmill.layers.vocab_embedding import ParallelLMHead, VocabParallelEmbedding
from tokenmill.models.cpu_decode import SmallBatchDecode


class LlamaAttention(nn.Module):
    def __init__(self, config: Any, tp: ParallelState, qkv_bias: bool, o_bias: bool,
                 qk_norm: bool) -> None:
        super().__init__()
        n_heads, n_kv = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // n_heads
        self.qkv_proj = QKVParallelLinear(config.hidden_size, self.head_dim, n_heads, n_kv,
                                          bias=qkv_bias, tp=tp)
        self.o_proj = RowParallelLinear(n_heads * self.head_dim, config.hidden_size,
                                        bias=o_bias, tp=tp)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        if qk_norm:  # Qwen3: RMSNorm over each head's q and k, before RoPE
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.qk_norm = qk_norm
        self.attn = Attention(self.num_heads, self.num_kv_heads, self.head_dim,
                              scale=self.head_dim ** -0.5)

    def forward(self, position_embeddings: tuple[torch.Tensor, torch.Tensor],
                hidden: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        T, Hq, Hkv = hidden.shape[0], self.num_heads, self.num_kv_heads
        # Views of the fused output by head (one view and three slices: the cheapest split,
        # which a batch-1 decode step pays in every layer).
        qkv = self.qkv_proj(hidden).view(T, Hq + 2 * Hkv, self.head_dim)
        q, k, v = qkv[:, :Hq], qkv[:, Hq:Hq + Hkv], qkv[:, Hq + Hkv:]  # (T, Hq|Hkv|Hkv, D)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotary(q, k, *position_embeddings)
        return self.o_proj(self.attn(q, k, v, meta))  # (T, hidden)


class LlamaMLP(nn.Module):
    def __init__(self, config: Any, tp: ParallelState) -> None:
        super().__init__()
        bias = getattr(config, "mlp_bias", False)
        inter = config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [inter, inter],
                                                       bias=bias, tp=tp)
        self.down_proj = RowParallelLinear(inter, config.hidden_size, bias=bias, tp=tp)
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: Any, tp: ParallelState, **attn_flags: bool) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, tp, **attn_flags)
        self.mlp = LlamaMLP(config, tp)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, position_embeddings: tuple[torch.Tensor, torch.Tensor],
                hidden: torch.Tensor, residual: torch.Tensor | None, meta: AttentionMetadata
                ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(position_embeddings, hidden, meta)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaModel(nn.Module):
    def __init__(self, config: Any, tp: ParallelState, **attn_flags: bool) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, tp, **attn_flags)
                                    for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        head_dim = getattr(config, "head_dim", None) or \
            config.hidden_size // config.num_attention_heads
        # One cos/sin table for all layers, gathered once per step.
        self.rotary_emb = RotaryEmbedding(head_dim, config.max_position_embeddings, config)
        # The same layers for a CPU decode step of a few tokens, without module dispatch.
        self.small_batch_decode = SmallBatchDecode(self.layers)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        hidden, residual = self.embed_tokens(input_ids), None  # (T, hidden)
        position_embeddings = self.rotary_emb(positions, hidden.dtype)  # cos, sin (T, 1, D)
        if self.small_batch_decode.applies(hidden):
            hidden, residual = self.small_batch_decode.run(hidden, *position_embeddings, meta)
        else:
            for layer in self.layers:
                hidden, residual = layer(position_embeddings, hidden, residual, meta)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class LlamaForCausalLM(nn.Module):
    # checkpoint module name → (our merged module, shard id)
    packed_modules_mapping = {
        "q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
    }
    qk_norm = False

    def __init__(self, config: Any, tp: ParallelState = ParallelState()) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config, tp, **self._attention_flags(config))
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, tp)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
            self.lm_head.tied = True

    def _attention_flags(self, config: Any) -> dict[str, bool]:
        bias = bool(getattr(config, "attention_bias", False))
        return {"qkv_bias": bias, "o_bias": bias, "qk_norm": self.qk_norm}

    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn.attn for layer in self.model.layers]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        """input_ids, positions (T,) → final hidden states (T, hidden)."""
        return self.model(input_ids, positions, meta)

    def compute_logits(self, hidden: torch.Tensor, logits_indices: torch.Tensor) -> torch.Tensor:
        return self.lm_head.compute_logits(hidden, logits_indices)


class Qwen2ForCausalLM(LlamaForCausalLM):
    def _attention_flags(self, config: Any) -> dict[str, bool]:
        return {"qkv_bias": True, "o_bias": False, "qk_norm": False}
