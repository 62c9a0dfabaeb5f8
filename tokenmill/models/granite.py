"""IBM Granite (3.x dense, `GraniteForCausalLM`): the Llama stack with four scalars from its
config, applied where transformers' modeling_granite.py applies them:

- embeddings x embedding_multiplier;
- attention scores scaled by attention_multiplier (instead of head_dim ** -0.5);
- each block's output (attention, MLP) x residual_multiplier before it joins the residual
  (the next add + RMSNorm adds it: the same sum as HF's residual + h * m);
- logits / logits_scaling.

The fused CPU decode call does not run these layers: Granite's attention and MLP redefine
their forward (the multipliers), so they state no op (layers/op_spec.py), and the call
applies no multipliers.
"""

from __future__ import annotations

from typing import Any

import torch

from tokenmill.attention import AttentionMetadata
from tokenmill.distributed import ParallelState
from tokenmill.models.llama import LlamaAttention, LlamaForCausalLM, LlamaMLP
from tokenmill.quantization import QuantizationConfig


class GraniteAttention(LlamaAttention):
    def __init__(self, config: Any, tp: ParallelState, quant: QuantizationConfig | None,
                 prefix: str, layer_idx: int, qkv_bias: bool, o_bias: bool) -> None:
        super().__init__(config, tp, quant, prefix, layer_idx, qkv_bias, o_bias)
        self.residual_multiplier = float(config.residual_multiplier)

    def attention_scale(self, config: Any) -> float:
        return float(config.attention_multiplier)

    def forward(self, position_embeddings: tuple[torch.Tensor, torch.Tensor],
                hidden: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        return super().forward(position_embeddings, hidden, meta) * self.residual_multiplier


class GraniteMLP(LlamaMLP):
    def __init__(self, config: Any, tp: ParallelState, quant: QuantizationConfig | None,
                 prefix: str, layer_idx: int | None = None) -> None:
        super().__init__(config, tp, quant, prefix, layer_idx)
        self.residual_multiplier = float(config.residual_multiplier)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * self.residual_multiplier


class GraniteForCausalLM(LlamaForCausalLM):
    attention_cls = GraniteAttention
    mlp_cls = GraniteMLP

    def __init__(self, config: Any, tp: ParallelState = ParallelState(),
                 quant_config: QuantizationConfig | None = None) -> None:
        super().__init__(config, tp, quant_config)
        self.logits_scaling = float(config.logits_scaling)

    def _embed_scale(self, config: Any) -> float:
        return float(config.embedding_multiplier)

    def compute_logits(self, hidden: torch.Tensor, logits_indices: torch.Tensor) -> torch.Tensor:
        return super().compute_logits(hidden, logits_indices) / self.logits_scaling


def gguf_config(meta: Any, tensor: Any, names: set[str]) -> dict[str, Any]:
    """llama.cpp's granite: its converter renames the four multipliers to *_scale and writes
    each only when it is not zero; absent, llama.cpp scales scores by head_dim ** -0.5 and
    leaves the others at 1."""
    head_dim = meta("attention.key_length") or (meta("embedding_length")
                                                // meta("attention.head_count"))
    return {"embedding_multiplier": meta("embedding_scale", 1.0),
            "residual_multiplier": meta("residual_scale", 1.0),
            "attention_multiplier": meta("attention.scale") or head_dim ** -0.5,
            "logits_scaling": meta("logit_scale", 1.0)}
