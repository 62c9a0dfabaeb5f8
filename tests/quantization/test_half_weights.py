"""bfloat16 / float16 checkpoints on CPU keep their weights as stored (no float32 copy): the dot
kernels widen them in registers (csrc/linear_half.h), exactly, so every product equals the
float32 kernel's on the widened weights bit for bit, and a model's greedy tokens and logprobs
equal its float32 load's and Hugging Face's (float32, same weights)."""

from __future__ import annotations

import shutil

import pytest
import torch

from tests.conftest import assert_kv_all_free, hf_greedy
from tokenmill import LLM, SamplingParams
from tokenmill.engine_args import engine_config
from tokenmill.layers import cpu_ops
from tokenmill.quantization.base import CPULinearKernel

pytestmark = pytest.mark.skipif(not cpu_ops.ops_available(), reason="C++ toolchain unavailable")
HALF = {torch.bfloat16: CPULinearKernel.BF16, torch.float16: CPULinearKernel.F16}


@pytest.mark.parametrize("dtype", list(HALF))
@pytest.mark.parametrize("invariant", [True, False])
def test_products_equal_float32_on_the_widened_weights(dtype, invariant):
    w = (torch.randn(72, 576) * 0.05).to(dtype)
    half = CPULinearKernel(HALF[dtype], 0, (w,), batch_invariant=invariant)
    dense = CPULinearKernel(CPULinearKernel.DENSE, 0, (w.float(),))
    bias = torch.randn(72)
    for m in (1, 2, 3, 4, 5, 13, 70):
        x = torch.randn(m, 576)
        assert torch.equal(cpu_ops.linear(x, half, bias), cpu_ops.linear(x, dense, bias))
    rows = torch.tensor([5, 0, 71, 5])
    assert torch.equal(cpu_ops.gather_rows(rows, half), w.float()[rows])


@pytest.fixture(scope="module", params=[torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def half_model(request, tiny_model, tmp_path_factory):
    """The tiny Llama written as a half-precision checkpoint, and HF's float32 model of the
    same (rounded) weights."""
    import transformers

    folder, _ = tiny_model("llama")
    out = tmp_path_factory.mktemp(f"llama-{request.param}")
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=request.param)
    hf.save_pretrained(out)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(f"{folder}/{f}", out / f)
    reference = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    return str(out), request.param, reference.eval()


def test_a_half_checkpoint_keeps_its_weights_and_decodes_as_float32(half_model):
    path, dtype, reference = half_model
    config = engine_config(path, device="cpu")
    assert config.model.dtype == torch.float32 and config.model.weight_dtype == dtype
    llm = LLM(path, num_kv_blocks=64)
    model = llm.engine.runner.model
    qkv = model.model.layers[0].self_attn.qkv_proj
    assert qkv.weight.dtype == dtype and qkv.quant_method.cpu_kernel(qkv).kind == HALF[dtype]
    assert model.model.embed_tokens.weight.dtype == dtype
    assert model.model.norm.weight.dtype == torch.float32  # norms stay float32
    prompts = [[1, 504, 3458, 282, 4649, 314], list(range(2000, 2050))]
    params = SamplingParams(temperature=0, max_tokens=10, logprobs=2, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert_kv_all_free(llm.engine)
    f32 = LLM(path, dtype="float32", num_kv_blocks=64)  # the same weights widened at load
    assert f32.engine.config.model.weight_dtype is None
    expected = f32.generate(prompts, params, use_tqdm=False)
    for got, want, prompt in zip(outs, expected, prompts, strict=True):
        assert got.outputs[0].token_ids == want.outputs[0].token_ids
        assert got.outputs[0].logprobs == want.outputs[0].logprobs  # bitwise
        assert list(got.outputs[0].token_ids) == hf_greedy(reference, prompt, 10)


def test_an_f16_gguf_file_keeps_its_weights_in_f16(tiny_model, smollm2_path, tmp_path):
    from tests.gguf_writer import write_gguf

    folder, hf = tiny_model("llama")
    path = str(tmp_path / "tiny-F16.gguf")
    write_gguf("llama", folder, hf, smollm2_path, tmp_path / "tiny-F16.gguf",
               {n: "F16" for n in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate",
                                   "ffn_up", "ffn_down", "token_embd")})
    native = LLM(path, num_kv_blocks=64)
    assert native.engine.config.model.quantization == "gguf"  # its own F16, by default
    mlp = native.engine.runner.model.model.layers[1].mlp
    assert mlp.gate_up_proj.weight.dtype == torch.float16
    prompts = [[1, 504, 3458, 282, 4649, 314]]
    params = SamplingParams(temperature=0, max_tokens=10, logprobs=2, ignore_eos=True)
    got = native.generate(prompts, params, use_tqdm=False)[0].outputs[0]
    want = LLM(path, quantization="none", num_kv_blocks=64).generate(
        prompts, params, use_tqdm=False)[0].outputs[0]
    assert got.token_ids == want.token_ids and got.logprobs == want.logprobs
