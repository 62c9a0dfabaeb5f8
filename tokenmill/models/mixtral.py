"""Mixtral: the Llama block with a sparse mixture of experts in place of the MLP.

Reads like transformers' modeling_mixtral.py: a router (`gate`, hidden → E logits) picks the
top-k experts per token, their weights renormalized to sum 1, and the experts run grouped
(layers/fused_moe.py). Checkpoints name the block `block_sparse_moe` with one w1 / w3 / w2 per
expert; `map_weight_name` puts them into the block's stacked expert weights. The block states
its op ("moe": the router's product, then the experts), so the fused CPU decode call runs it
(tests/models/test_moe.py).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from tokenmill.distributed import ParallelState
from tokenmill.layers.expert_weights import map_expert_weight
from tokenmill.layers.fused_moe import FusedMoE
from tokenmill.layers.linear import ColumnParallelLinear
from tokenmill.layers.op_spec import OpSpec, specs_of
from tokenmill.models.llama import LlamaForCausalLM
from tokenmill.quantization import QuantizationConfig


class MixtralMoE(nn.Module):
    computes = ("forward",)

    def __init__(self, config: Any, tp: ParallelState, quant: QuantizationConfig | None,
                 prefix: str, layer_idx: int) -> None:
        super().__init__()
        # the router is small and every rank needs all its logits: unsplit
        self.gate = ColumnParallelLinear(config.hidden_size, config.num_local_experts,
                                         bias=False, tp=ParallelState(), quant_config=None,
                                         prefix=f"{prefix}.gate")
        self.experts = FusedMoE(config.num_local_experts, config.num_experts_per_tok,
                                config.hidden_size, config.intermediate_size,
                                renormalize=True, tp=tp, quant_config=quant,
                                prefix=f"{prefix}.experts")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.experts(x, self.gate(x))  # (T, hidden)

    def op_spec(self) -> OpSpec | None:
        parts = specs_of(gate=self.gate, experts=self.experts)
        return None if parts is None else OpSpec("moe", parts=parts)


def gguf_config(meta: Any, tensor: Any, names: set[str]) -> dict[str, Any]:
    """llama.cpp's Mixtral ("llama" with experts): the experts' count and top-k."""
    return {"num_local_experts": meta("expert_count"),
            "num_experts_per_tok": meta("expert_used_count"), "sliding_window": None}


class MixtralForCausalLM(LlamaForCausalLM):
    mlp_cls = MixtralMoE

    @staticmethod
    def map_weight_name(name: str) -> tuple[str, Any] | None:
        """A checkpoint expert weight → (our parameter, (expert, w1 | w2 | w3)); the router
        `block_sparse_moe.gate` → `mlp.gate`; None for every other name."""
        if mapped := map_expert_weight(name, "block_sparse_moe"):
            return mapped
        if ".block_sparse_moe.gate." in name:
            return name.replace(".block_sparse_moe.", ".mlp."), None
        return None
