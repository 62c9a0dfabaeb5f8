"""RotaryEmbedding's table (layers/rotary.py): built on the device the model is built on, from
frequencies computed on the CPU for every RoPE type, equal to Hugging Face's own rotary module.

The first GPU run found every non-default RoPE type failing to build under
`torch.device("cuda")` (transformers' CPU frequencies met CUDA positions); the meta device
stands in for another device here."""

from __future__ import annotations

import pytest
import torch
import transformers

from tokenmill.layers.rotary import RotaryEmbedding

ROPES = {
    "default": {"rope_type": "default", "rope_theta": 10000.0},
    "linear": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0},
    "llama3": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
               "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64},
}


def config(rope: dict) -> transformers.LlamaConfig:
    return transformers.LlamaConfig(hidden_size=64, num_attention_heads=4,
                                    max_position_embeddings=256, rope_parameters=dict(rope))


@pytest.mark.parametrize("kind", list(ROPES))
def test_table_is_built_on_the_model_s_device(kind):
    with torch.device("meta"):
        rope = RotaryEmbedding(16, 256, config(ROPES[kind]))
    assert rope.cos.device.type == "meta" and rope.cos.shape == (256, 16)


@pytest.mark.parametrize("kind", list(ROPES))
def test_table_equals_hugging_face_s(kind):
    cfg = config(ROPES[kind])
    rope = RotaryEmbedding(16, 256, cfg)
    hf = transformers.models.llama.modeling_llama.LlamaRotaryEmbedding(cfg)
    positions = torch.arange(256)
    cos, sin = hf(torch.zeros(1, 256, 16), positions[None])
    cos_t, sin_t = rope(positions, torch.float32)
    torch.testing.assert_close(cos_t[:, 0], cos[0], rtol=0, atol=1e-6)
    torch.testing.assert_close(sin_t[:, 0], sin[0], rtol=0, atol=1e-6)
