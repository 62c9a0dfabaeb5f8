"""int8 / int4 quantized at load from a float checkpoint: the layers hold only their blocks,
and greedy output equals Hugging Face's forward on the dequantized weights (a
dequantize-then-float32 reference built here), for tied and untied heads."""

from __future__ import annotations

import copy

import pytest
import torch

from tests.conftest import assert_kv_all_free, hf_greedy
from tokenmill import LLM, SamplingParams
from tokenmill.layers import cpu_ops
from tokenmill.quantization import CPULinearKernel
from tokenmill.quantization.blocks import dequantize, quantize_q4, quantize_q8_0

pytestmark = pytest.mark.skipif(not cpu_ops.ops_available(), reason="C++ toolchain unavailable")


def reference_model(hf: torch.nn.Module, quantization: str) -> torch.nn.Module:
    """A copy of `hf` whose linear weights went through the format and back to float32:
    decoder layers in int8 (Q8_0) or int4 (Q4, groups of 32), embedding and head in Q8_0."""
    ref = copy.deepcopy(hf)

    def q8(w: torch.Tensor) -> torch.Tensor:
        return dequantize(CPULinearKernel(CPULinearKernel.Q8_0, 32, quantize_q8_0(w)))

    def q4(w: torch.Tensor) -> torch.Tensor:
        return dequantize(CPULinearKernel(CPULinearKernel.Q4, 32, quantize_q4(w, 32)))

    layer_fn = q8 if quantization == "int8" else q4
    with torch.no_grad():
        for name, module in ref.named_modules():
            if isinstance(module, torch.nn.Linear):
                fn = q8 if name == "lm_head" else layer_fn
                module.weight.copy_(fn(module.weight))
        emb = ref.get_input_embeddings()
        if ref.lm_head.weight is not emb.weight:
            emb.weight.copy_(q8(emb.weight))
    return ref


@pytest.mark.parametrize("kind", ["llama", "qwen2"])  # tied head; untied head with biases
@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_greedy_equals_dequantized_reference(kind, quantization, tiny_model):
    path, hf = tiny_model(kind)
    ref = reference_model(hf, quantization)
    llm = LLM(path, quantization=quantization)
    model = llm.engine.runner.model
    for module in model.modules():  # no float copy of a quantized weight is kept
        if hasattr(module, "blocks_q"):
            assert getattr(module, "weight", None) is None
    assert model.model.embed_tokens.blocks_q.dtype == torch.int8
    prompts = [[5, 900, 31, 7, 4000], list(range(100, 160)), [3]]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
                        use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(ref, p, 16) for p in prompts]
    assert_kv_all_free(llm.engine)


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
