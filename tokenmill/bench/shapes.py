"""Random-weight models of real shapes for the GPU benchmarks (benchmarks/real_shapes.py,
benchmarks/offline_throughput.py): a folder holding only a config.json of the real shape
(../shared/README.md: SmolLM2-135M, Llama-3.2-1B, Llama-3.1-8B) and a word-level tokenizer
over its vocabulary, loaded with `load_format="dummy"`. Real weights cannot reach the lent GPU
and speed does not depend on the values; nothing is downloaded.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

# name → config fields (Llama's config class unless ARCHITECTURES names another;
# ../shared/README.md)
SHAPES: dict[str, dict[str, Any]] = {
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, intermediate_size=128, vocab_size=512,
                 tie_word_embeddings=True),
    "smollm2": dict(hidden_size=576, num_hidden_layers=30, num_attention_heads=9,
                    num_key_value_heads=3, intermediate_size=1536, vocab_size=49152,
                    tie_word_embeddings=True, rope_theta=100000.0),
    "llama-1b": dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32,
                     num_key_value_heads=8, intermediate_size=8192, vocab_size=128256,
                     tie_word_embeddings=True, rope_theta=500000.0),
    "llama-8b": dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
                     num_key_value_heads=8, intermediate_size=14336, vocab_size=128256,
                     tie_word_embeddings=False, rope_theta=500000.0),
    # Qwen3-0.6B: per-head q/k RMSNorm, head_dim 128 over a hidden size of 1,024
    "qwen3-0.6b": dict(hidden_size=1024, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128, intermediate_size=3072,
                       vocab_size=151936, tie_word_embeddings=True, rope_theta=1000000.0),
}
# the config class of a shape whose architecture is not Llama's
ARCHITECTURES = {"qwen3-0.6b": ("Qwen3Config", "Qwen3ForCausalLM")}


def write_model_folder(name: str, out: Path) -> Path:
    """config.json of the shape and a word-level tokenizer ("<i>" for every id)."""
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    shape = SHAPES[name]
    folder = out / name
    config_cls, arch = ARCHITECTURES.get(name, ("LlamaConfig", "LlamaForCausalLM"))
    getattr(transformers, config_cls)(**shape, max_position_embeddings=4096, rms_norm_eps=1e-5,
                                      bos_token_id=1, eos_token_id=2,
                                      architectures=[arch]).save_pretrained(folder)
    vocab = {f"<{i}>": i for i in range(shape["vocab_size"])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<0>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<1>", eos_token="<2>",
                            unk_token="<0>").save_pretrained(folder)
    return folder
