"""GGUF Q5_0 / Q5_1 / Q4_K / Q5_K / Q6_K served from the file's own blocks, read in place by the
dot kernels (csrc/linear_gguf.h): every weight bit for bit as the gguf package dequantizes it,
every product bitwise the dense kernel's on those weights (at every step size, in merged
layers of mixed types), and a tiny K-quant model whose greedy tokens and logprobs equal its
float32 expansion's, through the fused decode call."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from tests.conftest import assert_kv_all_free
from tests.gguf_writer import write_gguf
from tokenmill import LLM, SamplingParams
from tokenmill.bench.real_gguf import random_blocks
from tokenmill.layers import cpu_ops
from tokenmill.models import cpu_decode
from tokenmill.quantization.base import CPULinearKernel
from tokenmill.quantization.blocks import dequantize
from tokenmill.quantization.gguf import GGUF_TYPES

pytestmark = pytest.mark.skipif(not cpu_ops.ops_available(), reason="C++ toolchain unavailable")
RAW_TYPES = ["Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K"]


def kernel_of(type_name: str, rows: int, cols: int, seed: int = 0) -> CPULinearKernel:
    raw = torch.from_numpy(random_blocks(type_name, rows, cols, seed))
    return CPULinearKernel(GGUF_TYPES[type_name].kind, 32, (raw,))


@pytest.mark.parametrize("type_name", RAW_TYPES)
def test_weights_are_the_gguf_packages_dequantization(type_name):
    kernel = kernel_of(type_name, 40, 512)
    raw = kernel.tensors[0].numpy()
    expected = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[type_name])
    rows = torch.tensor([0, 39, 7, 7, 20])
    got = cpu_ops.gather_rows(rows, kernel)  # embedding lookups through the kernels
    assert torch.equal(got, torch.from_numpy(np.ascontiguousarray(expected[rows.numpy()])))
    assert torch.equal(dequantize(kernel), torch.from_numpy(expected))


@pytest.mark.parametrize("type_name", RAW_TYPES)
@pytest.mark.parametrize("invariant", [True, False])
def test_products_equal_the_dense_kernel_on_the_same_weights(type_name, invariant):
    """The blocks have one kernel (the dot kernels), so even with batch invariance off a row's
    result is the dense invariant kernel's, at every M and with a bias."""
    kernel = kernel_of(type_name, 72, 768, seed=1)
    kernel = CPULinearKernel(kernel.kind, 32, kernel.tensors, batch_invariant=invariant)
    dense = CPULinearKernel(CPULinearKernel.DENSE, 0, (dequantize(kernel),))
    bias = torch.randn(72)
    for m in (1, 2, 3, 4, 5, 13, 70):
        x = torch.randn(m, 768)
        assert torch.equal(cpu_ops.linear(x, kernel, bias), cpu_ops.linear(x, dense, bias))


def test_a_merged_layer_of_mixed_types_is_its_parts_side_by_side():
    parts = [kernel_of("Q4_K", 64, 256, 2), kernel_of("Q4_K", 32, 256, 3),
             kernel_of("Q6_K", 32, 256, 4)]
    meta = torch.tensor([[k.kind, k.group, 1] for k in parts])
    merged = CPULinearKernel(CPULinearKernel.PARTS, 0, (meta, *(k.tensors[0] for k in parts)))
    weight = torch.cat([dequantize(k) for k in parts])
    assert torch.equal(dequantize(merged), weight)
    dense = CPULinearKernel(CPULinearKernel.DENSE, 0, (weight,))
    bias = torch.randn(128)
    for m in (1, 4, 9):
        x = torch.randn(m, 256)
        assert torch.equal(cpu_ops.linear(x, merged, bias), cpu_ops.linear(x, dense, bias))


# A Q4_K_M-like file: q and k in Q4_K, v in Q6_K (a mixed qkv), o in Q5_K, gate in Q5_0 and
# up in Q5_1 (a mixed gate_up), down in Q4_K, the tied embedding in Q6_K.
KQUANT_FILE = {"attn_q": "Q4_K", "attn_k": "Q4_K", "attn_v": "Q6_K", "attn_output": "Q5_K",
               "ffn_gate": "Q5_0", "ffn_up": "Q5_1", "ffn_down": "Q4_K", "token_embd": "Q6_K"}


@pytest.fixture(scope="module")
def kquant_file(tmp_path_factory, tiny_model, smollm2_path):
    folder, hf = tiny_model("llama-256")
    path = tmp_path_factory.mktemp("kquant") / "tiny-Q4_K_M.gguf"
    write_gguf("llama", folder, hf, smollm2_path, path, KQUANT_FILE)
    return str(path)


def test_a_kquant_model_serves_its_blocks_by_default_as_its_float32_expansion(
        kquant_file, monkeypatch):
    prompts = [[1, 504, 3458, 282, 4649, 314], list(range(2000, 2040))]
    params = SamplingParams(temperature=0, max_tokens=12, logprobs=2, ignore_eos=True)
    native = LLM(kquant_file, max_model_len=256, num_kv_blocks=64)
    assert native.engine.config.model.quantization == "gguf"  # the default for these types
    model = native.engine.runner.model
    qkv = model.model.layers[0].self_attn.qkv_proj
    kernel = qkv.quant_method.cpu_kernel(qkv)
    assert kernel.kind == CPULinearKernel.PARTS  # Q4_K q, k and Q6_K v, each in place
    assert [row[0] for row in kernel.tensors[0].tolist()] == [CPULinearKernel.Q4_K] * 2 + [
        CPULinearKernel.Q6_K]
    held = sum(p.numel() * p.element_size() for p in model.parameters())
    stored = sum(t.n_bytes for t in gguf.GGUFReader(kquant_file).tensors)
    assert held <= stored * 1.01  # the file's blocks, no float copy
    calls: list[int] = []
    real_op = cpu_decode._decode_layers_op()
    monkeypatch.setattr(cpu_decode, "_decode_layers_op",
                        lambda: lambda h, *a: (calls.append(h.shape[0]), real_op(h, *a))[1])
    outs = native.generate(prompts, params, use_tqdm=False)
    assert calls  # decode steps went through the fused call with the GGUF kernels
    assert_kv_all_free(native.engine)
    dense = LLM(kquant_file, quantization="none", max_model_len=256, num_kv_blocks=64)
    expected = dense.generate(prompts, params, use_tqdm=False)
    for got, want in zip(outs, expected, strict=True):
        assert got.outputs[0].token_ids == want.outputs[0].token_ids
        assert got.outputs[0].logprobs == want.outputs[0].logprobs  # bitwise


def test_int8_activations_are_refused_for_kquants(kquant_file):
    with pytest.raises(ValueError, match="int8_activations is not implemented for GGUF"):
        LLM(kquant_file, quantization="gguf", int8_activations=True, max_model_len=64)
