"""The converted copy of a GGUF model: made once, read instead of the GGUF file afterwards, equal
to what the GGUF file gives (config, tokenizer, chat template, every weight), keyed on the
file's identity, and optional: off, or unwritable, the GGUF file is read directly. The
float32 weights are written only when a start needs them: never for a file served in its own
blocks."""

from __future__ import annotations

import logging
import os
import shutil

import torch

from tokenmill.config_model import model_config
from tokenmill.engine.tokenizer import load_tokenizer
from tokenmill.model_loader.gguf_convert import converted_weights
from tokenmill.model_loader.gguf_loader import gguf_hf_config, iterate_gguf
from tokenmill.model_loader.loader import iterate_weights


def test_converted_copy_equals_the_gguf_file(smollm2_path, tmp_path, monkeypatch):
    monkeypatch.setenv("TOKENMILL_CACHE_DIR", str(tmp_path))
    first = model_config(smollm2_path)
    assert first.converted_dir is not None and first.converted_dir.startswith(str(tmp_path))
    assert first.gguf_file == smollm2_path
    weights = os.path.join(first.converted_dir, "model.safetensors")
    assert not os.path.exists(weights)  # written when a start first needs them
    assert converted_weights(first.converted_dir, smollm2_path) == first.converted_dir
    mtime = os.path.getmtime(weights)
    again = model_config(smollm2_path)  # reuses the folder, does not rewrite it
    assert again.converted_dir == first.converted_dir
    assert converted_weights(again.converted_dir, smollm2_path) == first.converted_dir
    assert os.path.getmtime(weights) == mtime
    assert [f for f in os.listdir(first.converted_dir) if ".tmp" in f] == []

    direct = gguf_hf_config(smollm2_path)
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "vocab_size", "rms_norm_eps",
                "rope_parameters", "tie_word_embeddings", "bos_token_id", "eos_token_id",
                "max_position_embeddings", "architectures"):
        assert getattr(again.hf_config, key) == getattr(direct, key), key

    monkeypatch.setenv("TOKENMILL_GGUF_CACHE", "0")
    plain = model_config(smollm2_path)
    assert plain.converted_dir is None
    tok_cached, tok_plain = load_tokenizer(again), load_tokenizer(plain)
    text = "Hello, world! Grüße 👋 <|im_end|>"
    assert tok_cached.encode(text) == tok_plain.encode(text)
    assert tok_cached.chat_template == tok_plain.chat_template
    assert tok_cached.all_special_ids == tok_plain.all_special_ids

    cached = dict(iterate_weights(again))
    n = 0
    for name, tensor in iterate_gguf(smollm2_path, direct):
        assert torch.equal(cached.pop(name), tensor), name
        n += 1
    assert n > 200 and not cached  # every tensor, nothing extra


def test_cache_is_keyed_on_the_file_and_optional(smollm2_path, tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("TOKENMILL_CACHE_DIR", str(tmp_path / "cache"))
    copy = tmp_path / "model.gguf"
    shutil.copyfile(smollm2_path, copy)
    a = model_config(str(copy)).converted_dir
    os.utime(copy, ns=(0, 10**18))  # the file "changed": a new conversion
    b = model_config(str(copy)).converted_dir
    assert a is not None and b is not None and a != b

    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    monkeypatch.setenv("TOKENMILL_CACHE_DIR", str(blocker / "sub"))
    with caplog.at_level(logging.WARNING):
        cfg = model_config(str(copy))
    assert cfg.converted_dir is None and "cannot cache" in caplog.text


def test_serving_the_blocks_writes_no_float32_weights(smollm2_path, tmp_path, monkeypatch):
    from tokenmill import LLM

    monkeypatch.setenv("TOKENMILL_CACHE_DIR", str(tmp_path))
    llm = LLM(smollm2_path, quantization="gguf", max_model_len=256)
    folder = llm.engine.config.model.converted_dir
    assert folder is not None and os.listdir(folder)  # config and tokenizer are cached
    assert not os.path.exists(os.path.join(folder, "model.safetensors"))
    dense = LLM(smollm2_path, quantization="none", max_model_len=256)  # needs them: writes
    assert os.path.isfile(os.path.join(folder, "model.safetensors"))
    assert dense.engine.config.model.converted_dir == folder


def test_later_starts_read_the_tensor_index_not_the_metadata(smollm2_path, tmp_path,
                                                             monkeypatch):
    """The first start writes where each tensor lies; later ones never open the gguf reader
    (its metadata parse is most of a large-vocabulary file's start), and read the same
    tensors, types and bytes."""
    import numpy as np

    from tokenmill.model_loader import gguf_loader
    from tokenmill.model_loader.gguf_index import INDEX_FILE

    monkeypatch.setenv("TOKENMILL_CACHE_DIR", str(tmp_path))
    gguf_loader.gguf_index.cache_clear()
    first = model_config(smollm2_path)
    assert os.path.isfile(os.path.join(first.converted_dir, INDEX_FILE))
    import gguf

    reader = gguf.GGUFReader(smollm2_path)  # the reference: the package's own reader
    stored = {t.name: (t.tensor_type.name, np.asarray(t.data)) for t in reader.tensors}
    types = gguf_loader.gguf_tensor_types(smollm2_path)
    raw = dict(iterate_gguf(smollm2_path, first.hf_config, raw_types=("Q4_1",)))
    gguf_loader.gguf_index.cache_clear()

    def no_reader(path):
        raise AssertionError("the gguf reader was opened")

    monkeypatch.setattr(gguf_loader, "gguf_reader", no_reader)
    assert gguf_loader.gguf_tensor_types(smollm2_path) == types
    assert gguf_loader.gguf_num_tensors(smollm2_path) == len(types)
    again = dict(iterate_gguf(smollm2_path, first.hf_config, raw_types=("Q4_1",)))
    assert again.keys() == raw.keys()
    assert all(np.array_equal(again[k].numpy(), raw[k].numpy()) for k in raw)
    from tokenmill.model_loader.gguf_index import tensor_data

    index = gguf_loader.gguf_index(smollm2_path)
    assert {t.name: t.type_name for t in index.tensors} == {n: v[0] for n, v in stored.items()}
    for t in index.tensors:
        data = tensor_data(smollm2_path, t)
        assert data.dtype == stored[t.name][1].dtype and np.array_equal(data, stored[t.name][1])
    gguf_loader.gguf_index.cache_clear()
