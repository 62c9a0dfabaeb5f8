"""GGUF files of the architectures llama.cpp defines beyond Llama / Qwen2 / Qwen3 (issue 21):
a tiny random-weight HF model is written as llama.cpp's converter would write it (its tensor
names, stacked experts, Llama's q/k row interleave, Gemma's norm weights + 1, Phi-3's fused
tensors and longrope factor tensors, the architecture's metadata; SmolLM2's tokenizer), read
back by tokenmill, and must be greedy-identical to the HF model it came from."""

from __future__ import annotations

import numpy as np
import pytest

from tests.conftest import generate_greedy, hf_greedy, mixed_prompts
from tests.gguf_writer import KINDS, write_gguf
from tokenmill import LLM


@pytest.mark.parametrize("kind", [k for k in KINDS if k != "llama"])
def test_gguf_of_architecture_is_greedy_identical_to_hf(tiny_model, smollm2_path, tmp_path,
                                                        kind):
    folder, hf = tiny_model(kind)
    path = tmp_path / f"{kind}.gguf"
    write_gguf(kind, folder, hf, smollm2_path, path)
    llm = LLM(str(path), max_num_batched_tokens=64)
    try:
        assert llm.engine.config.model.architecture == KINDS[kind][1]
        cases = mixed_prompts(5, hf.config.vocab_size, seed=11, max_len=120, max_new=16)
        got = generate_greedy(llm, cases)
    finally:
        llm.engine.shutdown()
    assert got == [hf_greedy(hf, p, m) for p, m in cases]


def test_gguf_experts_of_an_unknown_architecture_are_named(tmp_path):
    """A file whose architecture has experts tokenmill does not read (qwen2 with experts) is
    refused by name, not loaded as the dense model."""
    import gguf

    path = tmp_path / "odd.gguf"
    writer = gguf.GGUFWriter(str(path), "qwen2")
    writer.add_uint32("qwen2.expert_count", 4)
    writer.add_tensor("token_embd.weight", np.zeros((8, 4), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="unsupported GGUF architecture 'qwen2' with experts"):
        LLM(str(path))


@pytest.mark.parametrize("kind", ["llama", pytest.param("qwen2_moe", marks=pytest.mark.slow),
                                  pytest.param("gemma2", marks=pytest.mark.slow)])
def test_gguf_tokenizer_is_the_one_auto_tokenizer_builds(tiny_model, smollm2_path, tmp_path,
                                                         kind):
    """The tokenizer class chosen from tokenmill's own parse of the file (no second metadata
    parse) is AutoTokenizer's, and tokenizes alike: the generic fast tokenizer for Llama, the
    model-specific classes for Qwen2-MoE and Gemma 2."""
    from transformers import AutoTokenizer

    from tokenmill.engine.tokenizer import gguf_tokenizer
    from tokenmill.model_loader.gguf_loader import gguf_hf_config

    folder, hf = tiny_model(kind)
    path = tmp_path / f"{kind}.gguf"
    write_gguf(kind, folder, hf, smollm2_path, path)
    ours = gguf_tokenizer(str(path), gguf_hf_config(str(path)).model_type)
    auto = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    assert type(ours) is type(auto)
    text = "Hello  world!\n<|im_start|>user ünïcödé 🤖 2+2=4<|im_end|>"
    assert ours(text).input_ids == auto(text).input_ids
    assert ours.all_special_tokens == auto.all_special_tokens
    assert ours.chat_template == auto.chat_template
