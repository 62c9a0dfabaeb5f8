"""Which models serve LoRA adapters, and the shapes their targeted projections have.

The front-end checks an adapter against these shapes before any request uses it (the model
itself lives in the worker processes): a mismatch is an error naming the adapter, and the
engine serves on.
"""

from __future__ import annotations

from typing import Any

from tokenmill.lora.peft_files import TARGETS

# Dense decoder stacks whose projections are the checkpoint's q/k/v/o and gate/up/down (our
# merged qkv_proj / gate_up_proj split the adapter per part). Phi-3 (fused in the checkpoint)
# and the mixtures of experts are not served yet.
LORA_ARCHITECTURES = frozenset({
    "LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
    "GraniteForCausalLM", "Gemma2ForCausalLM", "Gemma3ForCausalLM"})


def check_architecture(architecture: str) -> None:
    if architecture not in LORA_ARCHITECTURES:
        raise ValueError(f"enable_lora: LoRA adapters are not served for {architecture} (they "
                         f"are for {', '.join(sorted(LORA_ARCHITECTURES))})")


def target_shapes(hf_config: Any) -> dict[str, tuple[int, int]]:
    """TARGETS entry → (input features, output features) of the full (unsharded) layer."""
    hidden = hf_config.hidden_size
    heads, kv_heads = hf_config.num_attention_heads, hf_config.num_key_value_heads
    head_dim = getattr(hf_config, "head_dim", None) or hidden // heads
    inter = hf_config.intermediate_size
    shapes = [(hidden, heads * head_dim), (hidden, kv_heads * head_dim),
              (hidden, kv_heads * head_dim), (heads * head_dim, hidden),
              (hidden, inter), (hidden, inter), (inter, hidden)]
    return dict(zip(TARGETS, shapes, strict=True))
