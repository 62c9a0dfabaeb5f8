"""Qwen2-MoE and Qwen3-MoE: the Qwen2 / Qwen3 blocks with a sparse mixture of experts.

Reads like transformers' modeling_qwen2_moe.py / modeling_qwen3_moe.py. A router (`gate`,
hidden → E logits) picks the top-k experts per token (softmax, top-k, renormalized only where
`norm_topk_prob` says so), the experts run grouped (layers/fused_moe.py); Qwen2-MoE adds a
shared expert (a gated MLP every token goes through) scaled by sigmoid(shared_expert_gate(x)).
Layers listed in `mlp_only_layers`, or off the `decoder_sparse_step` stride, keep a dense MLP
of `intermediate_size`. Checkpoint experts are `mlp.experts.{e}.gate_proj|up_proj|down_proj`.
The MoE block states its op ("moe", with "shared_expert" where it has one): the fused CPU
decode call runs Qwen2-MoE's layers (Qwen3-MoE's attention, with its q / k norms, states none).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from tokenmill.distributed import ParallelState
from tokenmill.layers import cpu_ops
from tokenmill.layers.expert_weights import map_expert_weight
from tokenmill.layers.fused_moe import FusedMoE
from tokenmill.layers.linear import ColumnParallelLinear
from tokenmill.layers.op_spec import OpSpec, specs_of
from tokenmill.models.llama import LlamaForCausalLM, LlamaMLP
from tokenmill.models.qwen3 import Qwen3Attention
from tokenmill.quantization import QuantizationConfig


def _num_experts(config: Any) -> int:
    """`num_experts`, which Qwen3-MoE's config class keeps as `num_local_experts` (an alias a
    plain config read back from a GGUF's converted copy does not have)."""
    return getattr(config, "num_experts", None) or config.num_local_experts


def _router(config: Any, out_features: int, prefix: str) -> ColumnParallelLinear:
    """A small unsplit projection every rank computes whole (the router, the shared gate)."""
    return ColumnParallelLinear(config.hidden_size, out_features, bias=False,
                                tp=ParallelState(), quant_config=None, prefix=prefix)


class QwenSparseMoeBlock(nn.Module):
    computes = ("forward",)

    def __init__(self, config: Any, tp: ParallelState, quant: QuantizationConfig | None,
                 prefix: str) -> None:
        super().__init__()
        num_experts = _num_experts(config)
        self.gate = _router(config, num_experts, f"{prefix}.gate")
        # OLMoE's experts are `intermediate_size` wide (it has no dense layers)
        inter = getattr(config, "moe_intermediate_size", None) or config.intermediate_size
        self.experts = FusedMoE(num_experts, config.num_experts_per_tok,
                                config.hidden_size, inter,
                                renormalize=bool(config.norm_topk_prob), tp=tp,
                                quant_config=quant, prefix=f"{prefix}.experts")
        shared = getattr(config, "shared_expert_intermediate_size", 0) or 0
        self.shared_expert = (LlamaMLP(config, tp, quant, f"{prefix}.shared_expert",
                                       intermediate_size=shared) if shared else None)
        self.shared_expert_gate = _router(config, 1, f"{prefix}.shared_expert_gate") \
            if shared else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.experts(x, self.gate(x))  # (T, hidden)
        if self.shared_expert is not None:
            out = out + cpu_ops.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out

    def op_spec(self) -> OpSpec | None:
        """The router's product, the experts, and the shared expert (a gated MLP) scaled by
        its sigmoid gate ("shared_expert") where the model has one."""
        shared = self.shared_expert is not None
        parts = specs_of(gate=self.gate, experts=self.experts,
                         **({"shared_expert": self.shared_expert,
                             "shared_expert_gate": self.shared_expert_gate} if shared else {}))
        return None if parts is None else OpSpec(
            "moe", frozenset({"shared_expert"} if shared else ()), parts=parts)


def qwen_moe_mlp(config: Any, tp: ParallelState, quant: QuantizationConfig | None,
                 prefix: str, layer_idx: int) -> nn.Module:
    """The layer's feed-forward block, as transformers' Qwen2MoeDecoderLayer chooses it."""
    sparse = (layer_idx not in (getattr(config, "mlp_only_layers", None) or [])
              and _num_experts(config) > 0
              and (layer_idx + 1) % getattr(config, "decoder_sparse_step", 1) == 0)
    if sparse:
        return QwenSparseMoeBlock(config, tp, quant, prefix)
    return LlamaMLP(config, tp, quant, prefix)


def map_qwen_moe_weight(name: str) -> tuple[str, Any] | None:
    """A checkpoint expert weight → (our stacked parameter, (expert, w1 | w3 | w2)); None for
    the rest (the router, the shared expert and gate keep their names)."""
    return map_expert_weight(name, "mlp")


def _gguf_moe(meta: Any) -> dict[str, Any]:
    return {"num_experts": meta("expert_count"), "num_experts_per_tok": meta("expert_used_count"),
            "moe_intermediate_size": meta("expert_feed_forward_length")}


def gguf_config_qwen2moe(meta: Any, tensor: Any, names: set[str]) -> dict[str, Any]:
    """llama.cpp's qwen2moe: a shared expert, top-k not renormalized; a layer stored with a
    dense MLP (ffn_down, no experts) is one of `mlp_only_layers`."""
    dense = [i for i in range(meta("block_count")) if f"blk.{i}.ffn_down.weight" in names]
    return _gguf_moe(meta) | {
        "shared_expert_intermediate_size": meta("expert_shared_feed_forward_length", 0),
        "norm_topk_prob": False, "decoder_sparse_step": 1, "mlp_only_layers": dense}


def gguf_config_qwen3moe(meta: Any, tensor: Any, names: set[str]) -> dict[str, Any]:
    """llama.cpp's qwen3moe: top-k renormalized."""
    return _gguf_moe(meta) | {"norm_topk_prob": True}


class Qwen2MoeForCausalLM(LlamaForCausalLM):
    mlp_cls = staticmethod(qwen_moe_mlp)
    map_weight_name = staticmethod(map_qwen_moe_weight)

    def _attention_flags(self, config: Any) -> dict[str, bool]:
        return {"qkv_bias": bool(getattr(config, "qkv_bias", True)), "o_bias": False}


class Qwen3MoeForCausalLM(LlamaForCausalLM):
    attention_cls = Qwen3Attention
    mlp_cls = staticmethod(qwen_moe_mlp)
    map_weight_name = staticmethod(map_qwen_moe_weight)
