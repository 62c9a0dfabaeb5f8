"""Phi-3 (and Phi-4-mini, the same architecture): the Llama block as transformers'
modeling_phi3.py computes it, with the checkpoint's q/k/v and gate/up already fused
(`self_attn.qkv_proj`, `mlp.gate_up_proj`), RoPE over the first `partial_rotary_factor` of
each head, longrope scaling (layers/rotary.py) and an optional sliding window.

The fused tensors are split back into the q / k / v and gate / up tensors they were made of
(`split_checkpoint_tensor`), so the loader fills our merged layers through the same shard
loaders as a Llama checkpoint, tensor-parallel split included. With full rotary and no window
the layers are exactly Llama's and the fused CPU decode call takes them (tests assert it);
partial rotary turns it off: the RoPE table states its "partial" variant, which the call does
not compute (layers/op_spec.py).
"""

from __future__ import annotations

from typing import Any

import torch

from tokenmill.models.llama import LlamaForCausalLM


def gguf_config(meta: Any, tensor: Any, names: set[str]) -> dict[str, Any]:
    """llama.cpp's phi3: longrope from its factor tensors, partial rotary from the rotated
    dimension count, the window where set."""
    head_dim = meta("attention.key_length") or meta("embedding_length") // \
        meta("attention.head_count")
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": float(meta("rope.freq_base",
                                                                             1e4))}
    rotated = meta("rope.dimension_count", head_dim)
    if rotated != head_dim:
        rope["partial_rotary_factor"] = rotated / head_dim
    original = meta("rope.scaling.original_context_length")
    long, short = tensor("rope_factors_long.weight"), tensor("rope_factors_short.weight")
    if long is not None and short is not None:
        rope.update(rope_type="longrope", long_factor=long.tolist(),
                    short_factor=short.tolist(), original_max_position_embeddings=original)
    out = {"rope_parameters": rope, "sliding_window": meta("attention.sliding_window")}
    if original is not None:
        out["original_max_position_embeddings"] = original
    return out


class Phi3ForCausalLM(LlamaForCausalLM):
    def split_checkpoint_tensor(self, name: str, tensor: torch.Tensor
                                ) -> list[tuple[str, torch.Tensor]]:
        """A fused checkpoint tensor → the unfused tensors under Llama's names; any other
        tensor as it is."""
        c = self.config
        if name.endswith(".self_attn.qkv_proj.weight"):
            d = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
            q, kv = c.num_attention_heads * d, c.num_key_value_heads * d
            parts = tensor.split([q, kv, kv], dim=0)
            return [(name.replace(".qkv_proj.", f".{p}."), t)
                    for p, t in zip(("q_proj", "k_proj", "v_proj"), parts, strict=True)]
        if name.endswith(".mlp.gate_up_proj.weight"):
            gate, up = tensor.chunk(2, dim=0)
            return [(name.replace(".gate_up_proj.", ".gate_proj."), gate),
                    (name.replace(".gate_up_proj.", ".up_proj."), up)]
        return [(name, tensor)]

    def _attention_flags(self, config: Any) -> dict[str, bool]:
        return {"qkv_bias": False, "o_bias": False}
