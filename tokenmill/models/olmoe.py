"""OLMoE: Llama attention with RMSNorm over the whole q and k projections (all heads at once,
before RoPE), optional clipping of q / k / v, and a sparse mixture of experts in every layer
(top-k of a softmax, not renormalized unless `norm_topk_prob`). Reads like transformers'
modeling_olmoe.py; the experts are the Qwen-MoE block's (models/qwen_moe.py) without a shared
expert. Normalizing across all heads would need the squares summed over tensor-parallel
ranks: tensor parallelism is refused for it at start-up, by name.
"""

from __future__ import annotations

from typing import Any

import torch

from tokenmill.attention import AttentionMetadata
from tokenmill.distributed import ParallelState
from tokenmill.layers.layernorm import RMSNorm
from tokenmill.layers.op_spec import OpSpec
from tokenmill.models.llama import LlamaAttention, LlamaForCausalLM, with_qk_norms
from tokenmill.models.qwen_moe import QwenSparseMoeBlock, map_qwen_moe_weight
from tokenmill.quantization import QuantizationConfig


class OlmoeAttention(LlamaAttention):
    computes = ("forward", "split_heads")

    def __init__(self, config: Any, tp: ParallelState, quant: QuantizationConfig | None,
                 prefix: str, layer_idx: int, qkv_bias: bool, o_bias: bool) -> None:
        if tp.tp_size > 1:
            raise ValueError("OlmoeForCausalLM normalizes q and k over all heads at once; "
                             "tensor_parallel_size > 1 is not supported for it")
        super().__init__(config, tp, quant, prefix, layer_idx, qkv_bias, o_bias)
        self.q_norm = RMSNorm(self.num_heads * self.head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(self.num_kv_heads * self.head_dim, config.rms_norm_eps)
        self.clip_qkv = getattr(config, "clip_qkv", None)

    def forward(self, position_embeddings: tuple[torch.Tensor, torch.Tensor],
                hidden: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        T, D = hidden.shape[0], self.head_dim
        q, k, v = self.qkv_proj(hidden).split(
            [self.num_heads * D, self.num_kv_heads * D, self.num_kv_heads * D], dim=-1)
        q, k = self.q_norm(q), self.k_norm(k)  # (T, Hq D), (T, Hkv D)
        if self.clip_qkv is not None:
            q, k, v = (t.clamp(-self.clip_qkv, self.clip_qkv) for t in (q, k, v))
        return self.o_proj(self.attn(q.view(T, -1, D), k.view(T, -1, D), v.reshape(T, -1, D),
                                     meta, position_embeddings))  # (T, hidden)

    def op_spec(self) -> OpSpec | None:
        """Llama's attention with one RMSNorm over all of q's heads and one over k's
        ("qk_norm_all_heads"), then q, k and v clamped to clip_qkv ("clip_qkv")."""
        variants = {"qk_norm_all_heads"} | ({"clip_qkv"} if self.clip_qkv is not None else set())
        return with_qk_norms(self, variants, clip_qkv=self.clip_qkv)


def gguf_config(meta: Any, tensor: Any, names: set[str]) -> dict[str, Any]:
    """llama.cpp's olmoe: the experts (as wide as feed_forward_length), top-k not
    renormalized, q / k / v clamped where the file says (attention.clamp_kqv)."""
    return {"num_experts": meta("expert_count"), "num_experts_per_tok": meta("expert_used_count"),
            "norm_topk_prob": False, "clip_qkv": meta("attention.clamp_kqv")}


def olmoe_mlp(config: Any, tp: ParallelState, quant: QuantizationConfig | None,
              prefix: str, layer_idx: int) -> QwenSparseMoeBlock:
    return QwenSparseMoeBlock(config, tp, quant, prefix)


class OlmoeForCausalLM(LlamaForCausalLM):
    attention_cls = OlmoeAttention
    mlp_cls = staticmethod(olmoe_mlp)
    map_weight_name = staticmethod(map_qwen_moe_weight)
