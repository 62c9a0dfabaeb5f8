"""int8 / int4 quantized at load from a float checkpoint: the layers hold only their blocks,
and greedy output equals Hugging Face's forward on the dequantized weights (a
dequantize-then-float32 reference built here), for tied and untied heads. int4's
activation-aware search: each layer's blocks are exactly Q4(W s) for the scale it chose,
the search never does worse than plain rounding, and it does better where a few input
channels carry outsized activations."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import agreement, assert_kv_all_free, hf_greedy, top1
from tests.quantization.reference import MERGED, hf_with_effective_weights, reference_model
from tokenmill import LLM, SamplingParams
from tokenmill.engine_args import engine_config
from tokenmill.layers import cpu_ops
from tokenmill.quantization import CPULinearKernel
from tokenmill.quantization.awq_search import search_scale
from tokenmill.quantization.blocks import dequantize, quantize_q4

pytestmark = pytest.mark.skipif(not cpu_ops.ops_available(), reason="C++ toolchain unavailable")


@pytest.mark.parametrize("kind", ["llama", "qwen2"])  # tied head; untied head with biases
@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_greedy_equals_dequantized_reference(kind, quantization, tiny_model):
    path, hf = tiny_model(kind)
    ref = reference_model(hf, quantization)  # embedding / head (and int8 layers) in Q8_0
    llm = LLM(path, quantization=quantization)
    model = llm.engine.runner.model
    if quantization == "int4":  # layers: W s rounded, x / s at run time
        check_int4_blocks(hf, model)
        ref = hf_with_effective_weights(ref, model)
    for module in model.modules():  # no float copy of a quantized weight is kept
        if hasattr(module, "blocks_q"):
            assert getattr(module, "weight", None) is None
    assert model.model.embed_tokens.blocks_q.dtype == torch.int8
    prompts = [[5, 900, 31, 7, 4000], list(range(100, 160)), [3]]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
                        use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(ref, p, 16) for p in prompts]
    assert_kv_all_free(llm.engine)


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_a_bf16_checkpoint_quantized_at_load_keeps_its_dtype_in_the_cache(
        quantization, bf16_checkpoint, tiny_model):
    """vLLM keeps a checkpoint's half precision in its KV cache whatever the weights' format:
    a bf16 checkpoint quantized at load (its layers computed in float32) takes a bfloat16
    cache under "auto". A float32 checkpoint, or float32 asked for as the dtype, keeps the
    model's float32 cache, and a cache format asked for is kept."""
    def cache_of(model: str, **options) -> str:
        return engine_config(model, device="cpu", quantization=quantization,
                             **options).cache.kv_cache_dtype

    assert cache_of(bf16_checkpoint) == "bfloat16"
    assert cache_of(tiny_model("llama")[0]) == "auto"
    assert cache_of(bf16_checkpoint, dtype="float32") == "auto"
    assert cache_of(bf16_checkpoint, kv_cache_dtype="float32") == "float32"
    llm = LLM(bf16_checkpoint, quantization=quantization)
    assert llm.engine.runner.kv_cache.dtype == torch.bfloat16
    outs = llm.generate([[5, 900, 31], list(range(100, 140))],
                        SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                        use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 8 for o in outs)
    assert_kv_all_free(llm.engine)


@pytest.mark.slow
@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_the_bf16_cache_keeps_smollm2s_quantized_top1_above_99_percent(quantization,
                                                                      smollm2_bf16):
    """The bf16 cache's loss on top of the quantized weights, stated: SmolLM2 as a bf16
    checkpoint quantized at load, teacher-forced over 1,000 positions of English text, picks
    the top-1 token of the same weights over a float32 cache at >= 99% of them (measured:
    99.8% for int8 and int4, fifty-sixth session)."""
    from tokenmill.bench.quant_quality import calibration_text

    tops = {}
    for kv in ("float32", "auto"):
        llm = LLM(smollm2_bf16, quantization=quantization, kv_cache_dtype=kv, max_model_len=512)
        ids = llm.engine.tokenizer.encode(calibration_text(8000), add_special_tokens=False)
        tops[llm.engine.config.cache.kv_cache_dtype] = top1(
            llm, [ids[i:i + 250] for i in range(0, 1000, 250)])
        del llm
    assert 0.99 <= agreement(tops["bfloat16"], tops["float32"]) < 1.0


def check_int4_blocks(hf: torch.nn.Module, model: torch.nn.Module) -> None:
    """Each 4-bit layer holds Q4(W / input_scale) of the checkpoint's W, in groups of 32:
    recomputed here from the stored scale, whose reciprocal is rounded, so equal up to a
    hundredth of a step."""
    for i, layer in enumerate(model.model.layers):
        for ours, theirs in MERGED.items():
            lin = layer.get_submodule(ours)
            kernel = lin.quant_method.cpu_kernel(lin)
            w = torch.cat([hf.model.layers[i].get_submodule(t).weight for t in theirs])
            if kernel.input_scale is not None:
                w = w / kernel.input_scale
            assert kernel.group == 32
            want = CPULinearKernel(CPULinearKernel.Q4, 32, quantize_q4(w.detach(), 32))
            step = want.tensors[1].float().max()
            torch.testing.assert_close(dequantize(kernel), dequantize(want), rtol=0,
                                       atol=1e-2 * float(step), msg=f"{i} {ours}")


def test_scale_search_never_loses_and_wins_on_outliers():
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(96, 256, generator=gen)
    x = torch.randn(512, 256, generator=gen)
    s, rtn, best = search_scale(w, x, 32)
    assert best <= rtn
    x[:, [3, 70, 200]] *= 30  # three outlier channels, as in SmolLM2's activations
    s, rtn, best = search_scale(w, x, 32)
    assert s is not None and best < 0.8 * rtn
    assert s[[3, 70, 200]].min() > s.median()  # the outliers' columns got finer steps


def test_quantized_weights_are_smaller(tiny_model):
    path, _ = tiny_model("qwen2")
    sizes = {}
    for q in (None, "int8", "int4"):
        model = LLM(path, quantization=q, prepack_weights=False).engine.runner.model
        sizes[q] = sum(p.numel() * p.element_size() for p in model.parameters())
    assert sizes["int8"] < 0.3 * sizes[None]
    assert sizes["int4"] < sizes["int8"]


def test_unknown_or_impossible_methods_fail_at_start_up(tiny_model):
    path, _ = tiny_model("llama")
    with pytest.raises(ValueError, match="unknown quantization 'fp3'.*int8, int4"):
        LLM(path, quantization="fp3")
    with pytest.raises(ValueError, match="not one"):
        LLM(path, quantization="gguf")
    with pytest.raises(ValueError, match="computes in float32"):
        LLM(path, quantization="int8", dtype="bfloat16")
    with pytest.raises(ValueError, match="int8_activations applies to quantized weights"):
        LLM(path, int8_activations=True)


def test_cli_flags_reach_the_engine():
    import argparse

    from tokenmill.engine_args import EngineArgs

    p = argparse.ArgumentParser()
    EngineArgs.add_cli_args(p)
    opts = EngineArgs.cli_options(p.parse_args(["--quantization", "gguf", "--int8-activations",
                                        "--no-prepack-weights"]))
    assert opts == {"quantization": "gguf", "int8_activations": True,
                    "prepack_weights": False}
    with pytest.raises(SystemExit):  # argparse names the choices
        p.parse_args(["--quantization", "fp3"])


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_int8_activations_spare_the_attention_input(tiny_model, method):
    """With int8 activations every quantized linear layer rounds them except qkv_proj (its
    input is the RMSNorm output, whose outliers int8 rounding hurts most) and the LM head."""
    path, _ = tiny_model("llama")
    model = LLM(path, quantization=method, int8_activations=True).engine.runner.model
    layer = model.model.layers[0]
    acts = {name: lin.quant_method.cpu_kernel(lin).int8_activations
            for name, lin in [("qkv", layer.self_attn.qkv_proj), ("o", layer.self_attn.o_proj),
                              ("gate_up", layer.mlp.gate_up_proj), ("down", layer.mlp.down_proj),
                              ("embedding (and tied head)", model.model.embed_tokens)]}
    assert acts == {"qkv": False, "o": True, "gate_up": True, "down": True,
                    "embedding (and tied head)": False}
