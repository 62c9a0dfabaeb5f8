"""Block-scaled fp8 checkpoints (quant_method "fp8", weight_block_size, as Qwen3-*-FP8 ship):
served as stored, the product exactly the checkpoint's weights'. On CPU each weight is
dequantized once at load (greedy == Hugging Face on the dequantized weights, token for token);
the CUDA branch (the Triton GEMM over the e4m3 bytes and tile scales, routed here on CPU
tensors into the interpreted kernel) gives the same tokens; what is not served fails at
start-up by name."""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from tests.conftest import assert_kv_all_free, generate_greedy, hf_greedy, mixed_prompts
from tokenmill import LLM
from tokenmill.attention.triton_paged import triton_available
from tokenmill.layers import cpu_ops
from tokenmill.quantization.fp8 import FP8, FP8_MAX, dequantize_blocks

BLOCK = [32, 32]  # small tiles, so that the tiny model's layers hold several


def quantize_blocks(w: torch.Tensor, block: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(N, K) float → e4m3 (N, K) and (N / b0, K / b1) scales, amax / 448 per tile (the
    checkpoints' recipe)."""
    n, k = w.shape
    tiles = w.float().view(n // block[0], block[0], k // block[1], block[1])
    scale = tiles.abs().amax(dim=(1, 3)).clamp(min=1e-12) / FP8_MAX
    q = (tiles / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q.view(n, k), scale


def write_fp8_checkpoint(src: str, out: Path, **config_extra) -> dict[str, torch.Tensor]:
    """The tiny float checkpoint at `src` with every decoder linear weight stored in fp8
    (weight + weight_scale_inv); returns name → the dequantized weight."""
    from safetensors.torch import load_file

    out.mkdir()
    for f in Path(src).iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, out / f.name)
    tensors, dequantized = {}, {}
    for name, t in load_file(f"{src}/model.safetensors").items():
        if ".layers." in name and name.endswith("proj.weight"):
            q, scale = quantize_blocks(t, BLOCK)
            tensors[name], tensors[name + "_scale_inv"] = q, scale
            dequantized[name] = dequantize_blocks(q, scale, tuple(BLOCK))
        else:
            tensors[name] = t
    save_file(tensors, str(out / "model.safetensors"))
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic",
                                     "fmt": "e4m3", "weight_block_size": BLOCK, **config_extra}
    (out / "config.json").write_text(json.dumps(config))
    return dequantized


@pytest.fixture(scope="module")
def fp8_checkpoint(tiny_model, tmp_path_factory):
    path, hf = tiny_model("llama")
    out = tmp_path_factory.mktemp("fp8") / "ckpt"
    dequantized = write_fp8_checkpoint(path, out)
    ref = copy.deepcopy(hf)
    with torch.no_grad():
        for name, w in dequantized.items():
            ref.get_parameter(name).copy_(w)
    cases = [(p, 10) for p, _ in mixed_prompts(4, hf.config.vocab_size, seed=11, max_len=60)]
    return str(out), cases, [hf_greedy(ref, p, m) for p, m in cases]


@pytest.mark.skipif(not cpu_ops.ops_available(), reason="C++ kernels not built")
def test_fp8_checkpoint_on_cpu_is_its_dequantized_weights(fp8_checkpoint):
    path, cases, expected = fp8_checkpoint
    llm = LLM(path, device="cpu")  # the checkpoint's own format, picked from its config
    assert llm.engine.config.model.quantization == "fp8"
    assert llm.engine.config.batch_invariant  # dense float32 weights on CPU
    qkv = llm.engine.runner.model.model.layers[0].self_attn.qkv_proj
    assert qkv.weight.dtype == torch.float32 and not hasattr(qkv, "weight_fp8")
    assert generate_greedy(llm, cases) == expected
    assert_kv_all_free(llm.engine)


@pytest.mark.skipif(not triton_available(), reason="triton not installed")
def test_fp8_checkpoint_cuda_branch_gives_the_same_tokens(fp8_checkpoint, monkeypatch):
    from tokenmill.quantization import fp8, triton_block_gemm

    path, cases, expected = fp8_checkpoint
    calls = []
    real = triton_block_gemm.fp8_block_linear

    def counted(*args, **kw):
        calls.append(1)
        return real(*args, **kw)

    monkeypatch.setattr(fp8, "on_cuda", lambda t: True)
    monkeypatch.setattr(triton_block_gemm, "fp8_block_linear", counted)
    llm = LLM(path, attention_backend="torch", batch_invariant=False)
    qkv = llm.engine.runner.model.model.layers[0].self_attn.qkv_proj
    assert qkv.weight_fp8.dtype == FP8 and qkv.weight_scale_inv.shape == (128 // 32, 64 // 32)
    assert generate_greedy(llm, cases[:2]) == expected[:2]
    assert calls


def test_fp8_checkpoints_not_served_fail_by_name(tiny_model, tmp_path):
    path, _ = tiny_model("llama")
    for i, (extra, match) in enumerate([
            (dict(weight_block_size=None), "only block-scaled fp8 checkpoints"),
            (dict(activation_scheme="static"), "only dynamic activations"),
            (dict(fmt="e5m2"), "only e4m3")]):
        out = tmp_path / str(i)
        write_fp8_checkpoint(path, out, **extra)
        with pytest.raises(ValueError, match=match):
            LLM(str(out))
    with pytest.raises(ValueError, match="quantization='int8', but .* is a fp8 checkpoint"):
        LLM(str(tmp_path / "0"), quantization="int8")
    with pytest.raises(ValueError, match="load_format='dummy'"):
        LLM(str(tmp_path / "0"), load_format="dummy")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_fp8_checkpoint_on_cuda(fp8_checkpoint):
    path, cases, expected = fp8_checkpoint
    llm = LLM(path, device="cuda", dtype="float32")
    assert llm.engine.runner.model.model.layers[0].mlp.down_proj.weight_fp8.dtype == FP8
    assert generate_greedy(llm, cases) == expected
    assert len(generate_greedy(LLM(path, device="cuda", dtype="bfloat16"), cases)[0]) == 10
