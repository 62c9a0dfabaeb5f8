"""The tokenizer loader: the direct fast-tokenizer path gives AutoTokenizer's tokenizer."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from transformers import AutoTokenizer

from tokenmill.config import ModelConfig
from tokenmill.engine.tokenizer import generic_fast_tokenizer, load_tokenizer


def _config(path) -> ModelConfig:
    return ModelConfig(path=str(path), hf_config=None, architecture="LlamaForCausalLM",
                       dtype=torch.float32, max_model_len=64)


TEXTS = ["Hello, world!", "  leading spaces and\nnewlines\t", "<|im_start|>user\nhé 日本<|im_end|>",
         "def f(x):\n    return x ** 2  # 🙂"]
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}]


def test_generic_folder_loads_directly_and_matches_autotokenizer(tokenizer_dir):
    assert generic_fast_tokenizer(str(tokenizer_dir))
    ours = load_tokenizer(_config(tokenizer_dir))
    auto = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    for text in TEXTS:
        ids = ours(text).input_ids
        assert ids == auto(text).input_ids
        assert ours.decode(ids) == auto.decode(ids)
    assert ours.all_special_ids == auto.all_special_ids
    assert ours.eos_token_id == auto.eos_token_id
    assert (ours.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
            == auto.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True))


def test_model_specific_class_goes_through_autotokenizer(tokenizer_dir, tmp_path):
    for f in tokenizer_dir.iterdir():
        shutil.copy(f, tmp_path / f.name)
    cfg_file = tmp_path / "tokenizer_config.json"
    cfg = json.loads(cfg_file.read_text())
    cfg["tokenizer_class"] = "GPT2Tokenizer"
    cfg_file.write_text(json.dumps(cfg))
    assert not generic_fast_tokenizer(str(tmp_path))
    (tmp_path / "tokenizer.json").unlink()
    cfg["tokenizer_class"] = "TokenizersBackend"
    cfg_file.write_text(json.dumps(cfg))
    assert not generic_fast_tokenizer(str(tmp_path))  # no tokenizer.json: nothing to load


def test_missing_tokenizer_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="cannot load a tokenizer"):
        load_tokenizer(_config(tmp_path))


def test_chat_template_from_a_file_or_inline(tmp_path):
    """vLLM's --chat-template rule: a readable file's text; else the template itself when it
    holds Jinja's characters (escaped newlines decoded); else a path that failed: an error."""
    from tokenmill.engine.tokenizer import load_chat_template

    path = tmp_path / "t.jinja"
    path.write_text("{{ messages[0]['content'] }}\n")
    assert load_chat_template(str(path)) == "{{ messages[0]['content'] }}\n"
    assert load_chat_template("{{ x }}\\nnext") == "{{ x }}\nnext"
    assert load_chat_template(None) is None
    with pytest.raises(ValueError, match="looks like a file path"):
        load_chat_template(str(tmp_path / "missing.jinja"))
