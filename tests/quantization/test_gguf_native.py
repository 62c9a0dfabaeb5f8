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
    return LLM(smollm2_path, quantization="gguf", max_model_len=512)


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
    from tokenmill.config_factory import model_config
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
