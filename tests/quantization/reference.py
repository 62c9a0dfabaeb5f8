"""Dequantize-then-float32 references: a Hugging Face model given the weights a tokenmill
model multiplies by (each linear layer's effective weight, merged layers split back)."""

from __future__ import annotations

import copy

import torch

from tokenmill.quantization import CPULinearKernel
from tokenmill.quantization.blocks import dequantize, effective_weight, quantize_q4, quantize_q8_0

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


def reference_model(hf: torch.nn.Module, quantization: str) -> torch.nn.Module:
    """A copy of `hf` whose linear weights went through the format and back to float32:
    decoder layers in int8 (Q8_0) or int4 (Q4, groups of 32), embedding and head in Q8_0."""
    ref = copy.deepcopy(hf)

    def q8(w: torch.Tensor) -> torch.Tensor:
        return dequantize(CPULinearKernel(CPULinearKernel.Q8_0, 32, quantize_q8_0(w)))

    def q4(w: torch.Tensor) -> torch.Tensor:
        return dequantize(CPULinearKernel(CPULinearKernel.Q4, 32, quantize_q4(w, 32)))

    with torch.no_grad():
        for name, module in ref.named_modules():
            if isinstance(module, torch.nn.Linear):
                fn = q8 if name == "lm_head" or quantization == "int8" else q4
                module.weight.copy_(fn(module.weight))
        emb = ref.get_input_embeddings()
        if ref.lm_head.weight is not emb.weight:
            emb.weight.copy_(q8(emb.weight))
    return ref
