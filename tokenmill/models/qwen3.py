"""Qwen3: the Llama block with RMSNorm on each head's q and k before RoPE, biases per config."""

from __future__ import annotations

from tokenmill.models.llama import LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    qk_norm = True
