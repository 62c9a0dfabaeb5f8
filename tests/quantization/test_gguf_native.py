"""The shipped SmolLM2 GGUF (Q4_1 layers, Q8_0 tied embedding) served from its own blocks:
the layers hold the file's blocks bit for bit (no float copy), greedy output equals the
float32 expansion of the same file (identical weights: only summation order differs), and
it is the default on every CPU with the C++ kernels."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import assert_kv_all_free
from tokenmill import LLM, SamplingParams
from tokenmill.engine_args import engine_config
from tokenmill.layers import cpu_ops
from tokenmill.model_loader.gguf_loader import iterate_gguf
from tokenmill.quantization.blocks import dequantize

pytestmark = pytest.mark.skipif(not cpu_ops.ops_available(), reason="C++ toolchain unavailable")


@pytest.fixture(scope="module")
def native(smollm2_path):
    # a float32 cache as the expansion's (the default is bf16): the weights alone compare
    return LLM(smollm2_path, quantization="gguf", max_model_len=512, kv_cache_dtype="float32")


def test_blocks_are_the_files_weights(native):
    model = native.engine.runner.model
    expanded = dict(iterate_gguf(native.engine.config.model.gguf_file,
                                 native.engine.config.model.hf_config))
    layer = model.model.layers[3]
    qkv = dequantize(layer.self_attn.qkv_proj.quant_method.cpu_kernel(layer.self_attn.qkv_proj))
    expected = torch.cat([expanded[f"model.layers.3.self_attn.{p}_proj.weight"]
                          for p in "qkv"])
    assert torch.equal(qkv, expected)  # un-permuted rows, same numbers
    embed = model.model.embed_tokens
    assert torch.equal(dequantize(embed.quant_method.cpu_kernel(embed)),
                       expanded["model.embed_tokens.weight"])
    assert model.lm_head.tied_to is embed
    float_bytes = sum(t.numel() * 4 for t in expanded.values())
    held = sum(p.numel() * p.element_size() for p in model.parameters())
    assert held < 0.2 * float_bytes  # blocks only: ~0.6 bytes a weight


def test_greedy_equals_float32_expansion(native, smollm2_path):
    dense = LLM(smollm2_path, quantization="none", max_model_len=512)
    prompts = [[1, 504, 3458, 282, 4649, 314], list(range(2000, 2100))]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    outs = [[o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
            for llm in (native, dense)]
    assert outs[0] == outs[1]
    chat = native.chat([[{"role": "user", "content": "What is the capital of France?"}]],
                       SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)
    assert "Paris" in chat[0].outputs[0].text
    assert_kv_all_free(native.engine)


def test_unsupported_tensor_types_are_named(monkeypatch, smollm2_path):
    from tokenmill.model_loader import gguf_loader

    real = gguf_loader.gguf_tensor_types
    monkeypatch.setattr(gguf_loader, "gguf_tensor_types", lambda path: {
        **real(path), "model.layers.0.mlp.down_proj.weight": "IQ2_XXS"})
    with pytest.raises(ValueError, match="IQ2_XXS cannot be served natively.*Q8_0, Q4_1, "
                                         "Q4_0, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K, Q3_K, Q2_K, "
                                         "IQ4_XS, IQ4_NL"):
        LLM(smollm2_path, quantization="gguf", max_model_len=64)


@pytest.mark.parametrize("kernels,device,expected", [(True, "cpu", "gguf"),
                                                     (False, "cpu", None),
                                                     (True, "cuda", None)])
def test_default_serves_the_blocks_on_the_cpu_kernels(monkeypatch, smollm2_path, kernels,
                                                      device, expected):
    from tokenmill.config_model import model_config
    from tokenmill.config_weights import default_quantization
    from tokenmill.utils import cpp_extension

    monkeypatch.setattr(cpp_extension, "kernels_enabled", lambda: kernels)
    assert default_quantization(model_config(smollm2_path), device) == expected


def test_default_is_only_a_default(monkeypatch, smollm2_path, tiny_model):
    from tokenmill.model_loader import gguf_loader
    from tokenmill.utils import cpp_extension

    monkeypatch.setattr(cpp_extension, "kernels_enabled", lambda: True)
    assert engine_config(smollm2_path, device="cpu").model.quantization == "gguf"
    # "none" asks for the float32 expansion; an explicit method is kept
    assert engine_config(smollm2_path, quantization="none").model.quantization is None
    assert engine_config(smollm2_path, quantization="int8").model.quantization == "int8"
    # an HF folder, and a file with types its blocks are not served in, stay dense
    assert engine_config(tiny_model("llama")[0]).model.quantization is None
    real = gguf_loader.gguf_tensor_types
    monkeypatch.setattr(gguf_loader, "gguf_tensor_types", lambda path: {
        **real(path), "model.layers.0.mlp.down_proj.weight": "IQ3_XXS"})
    assert engine_config(smollm2_path, device="cpu").model.quantization is None


def test_the_blocks_default_to_a_bf16_cache(smollm2_path, tiny_model, bf16_checkpoint):
    """llama.cpp's cache is 16-bit by default and vLLM's the checkpoint's half precision: a
    GGUF file served in its blocks takes a bfloat16 cache under "auto"; "float32" keeps the
    expansion's exact cache, which the dense expansion keeps by default; a model computing
    in another dtype (a bf16 checkpoint asked in float16: served as asked) cannot ask for
    it."""
    assert engine_config(smollm2_path, device="cpu").cache.kv_cache_dtype == "bfloat16"
    assert engine_config(smollm2_path, device="cpu",
                         kv_cache_dtype="float32").cache.kv_cache_dtype == "float32"
    assert engine_config(smollm2_path, device="cpu",
                         kv_cache_dtype="int8").cache.kv_cache_dtype == "int8"
    assert engine_config(smollm2_path, quantization="none").cache.kv_cache_dtype == "auto"
    assert engine_config(tiny_model("llama")[0]).cache.kv_cache_dtype == "auto"
    with pytest.raises(ValueError, match="'float32' keeps a float32 model's K and V"):
        engine_config(bf16_checkpoint, dtype="float16", kv_cache_dtype="float32")


def test_the_bf16_cache_agrees_with_the_float32_one(native, smollm2_path):
    """The default cache's loss, stated: teacher-forced over English text, the top-1 token at
    each position agrees with the float32 cache's (same blocks) at >= 97% (measured on 4,088
    tokens: 99.85%, benchmarks/quant_quality.py), and the chosen tokens' logprobs stay close."""
    default = LLM(smollm2_path, max_model_len=512)
    assert default.engine.config.cache.kv_cache_dtype == "bfloat16"
    text = ("The river rose through the night, and by morning the lower town was under water. "
            "People carried what they could to the church on the hill, where the priest had "
            "opened the doors and lit the stoves. Nobody had seen a flood like it since the "
            "winter the bridge went down, and the old men argued about whether this one was "
            "worse. By noon the rain had stopped, but the water kept coming from the hills.")
    prompt = native.get_tokenizer().encode(text)
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1)
    tops, chosen = [], []
    for llm in (default, native):
        out = llm.generate([prompt], params, use_tqdm=False)[0]
        tops.append([min(d.items(), key=lambda kv: kv[1].rank)[0]
                     for d in out.prompt_logprobs[1:]])
        chosen.append(torch.tensor([d[t].logprob for d, t in zip(out.prompt_logprobs[1:],
                                                                   prompt[1:], strict=True)]))
    agree = sum(a == b for a, b in zip(*tops, strict=True)) / len(tops[0])
    assert len(tops[0]) > 60 and agree >= 0.97
    assert not torch.equal(chosen[0], chosen[1])  # the caches differ: the check compares
    assert float((chosen[0] - chosen[1]).abs().mean()) < 0.02
