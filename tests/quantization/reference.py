"""Dequantize-then-float32 references: a Hugging Face model given the weights a tokenmill
model multiplies by (each linear layer's effective weight, merged layers split back)."""

from __future__ import annotations

import copy

import torch

from tokenmill.quantization.blocks import effective_weight

MERGED = {"self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
          "self_attn.o_proj": ("self_attn.o_proj",),
          "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
          "mlp.down_proj": ("mlp.down_proj",)}


@torch.no_grad()
def hf_with_effective_weights(hf: torch.nn.Module, model: torch.nn.Module) -> torch.nn.Module:
    """A copy of `hf` whose decoder linear weights are those `model` (tokenmill's, loaded)
    computes with."""
    ref = copy.deepcopy(hf)
    for i, layer in enumerate(model.model.layers):
        for ours, theirs in MERGED.items():
            lin = layer.get_submodule(ours)
            w = effective_weight(lin.quant_method.blocks_kernel(lin))
            start = 0
            for name in theirs:
                target = ref.model.layers[i].get_submodule(name).weight
                target.copy_(w[start:start + target.shape[0]])
                start += target.shape[0]
            assert start == w.shape[0]
    return ref
