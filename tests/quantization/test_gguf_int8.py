"""GGUF K-quants (Q2_K .. Q6_K) multiplying int8 activations (`int8_activations=True`,
csrc/linear_gguf_int8.h): x rounded to int8 per 256 values, the file's super-blocks read in
place; Q5_0 and IQ4_NL blocks held as the Q8_0 blocks of the same weights, exactly. Each
product is the gguf package's dequantized weights times the rounded x, up to the kernel's
float32 sums, in every installed build, the AVX-512 and AVX2 builds bit for bit; a row's
result is bitwise the same at every step size (raw rows up to 12, interleaved tiles above);
the int8 sums do not saturate at the kinds' extremes; tiny models of these types serve
through the fused decode call with logprobs near their float32 expansion's, each prompt's
tokens the same alone or batched."""

from __future__ import annotations

import importlib

import gguf
import pytest
import torch

from tests.conftest import assert_kv_all_free
from tests.gguf_writer import write_gguf
from tests.quantization.test_blocks import round_blocks
from tests.quantization.test_gguf_kquants import constant_rows, extreme_rows
from tokenmill import LLM, SamplingParams
from tokenmill.bench.real_gguf import random_blocks
from tokenmill.layers import cpu_ops
from tokenmill.models import cpu_decode
from tokenmill.quantization import block_tiles
from tokenmill.quantization.base import CPULinearKernel
from tokenmill.quantization.blocks import dequantize
from tokenmill.quantization.gguf import GGUF_TYPES, kernel_tensors
from tokenmill.utils.cpp_extension import runtime_isa

pytestmark = pytest.mark.skipif(not cpu_ops.ops_available(), reason="C++ toolchain unavailable")
INT8_TYPES = ["Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"]


@pytest.fixture
def ops(cpu_ops_build):
    """Each SIMD kernel build this CPU runs: the portable one has no int8 K-quant kernel."""
    if cpu_ops.gguf_activation_block(256, cpu_ops_build) is None:
        pytest.skip("the portable build refuses int8 activations for K-quants")
    return cpu_ops_build


def int8_kernel(type_name: str, rows: int, cols: int, seed: int) -> CPULinearKernel:
    raw = torch.from_numpy(random_blocks(type_name, rows, cols, seed))
    return CPULinearKernel(GGUF_TYPES[type_name].kind, 32, (raw,), int8_activations=True)


def expected(x: torch.Tensor, kernel: CPULinearKernel, bias: torch.Tensor) -> torch.Tensor:
    """dequantize(W) times x rounded to int8 per 256 values, in float64."""
    xr = round_blocks(x, 127, 256)
    return (xr.double() @ dequantize(kernel).double().T + bias.double()).float()


@pytest.mark.parametrize("type_name", ["Q5_0", "IQ4_NL"])
def test_32_weight_kinds_are_held_as_q8_0_blocks_of_the_same_weights(type_name):
    raw = random_blocks(type_name, 16, 96, seed=3)
    q, d = kernel_tensors(torch.from_numpy(raw), type_name, int8_activations=True)
    kernel = CPULinearKernel(CPULinearKernel.Q8_0, 32, (q, d), int8_activations=True)
    want = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[type_name])
    assert torch.equal(dequantize(kernel), torch.from_numpy(want))
    assert GGUF_TYPES[type_name].served(False)[0].name == type_name  # int16: its own blocks


@pytest.mark.parametrize("type_name", INT8_TYPES)
def test_products_are_the_weights_times_int8_rounded_activations_at_every_m(ops, type_name):
    torch.manual_seed(0)
    kernel = int8_kernel(type_name, 73, 768, seed=1)  # odd N; three super-blocks a row
    bias = torch.randn(73)
    w = dequantize(kernel).double()
    # raw passes up to 5, 7 (Q3_K) or 12 rows (Q6_K), tiles above
    for m in (1, 2, 3, 5, 6, 7, 8, 9, 12, 13, 17, 70):
        x = torch.randn(m, 768) * torch.logspace(-1, 1, 768)  # blocks of very different ranges
        y = cpu_ops.linear(x, kernel, bias, ops)
        torch.testing.assert_close(y, expected(x, kernel, bias), atol=1e-4, rtol=1e-5)
        for i in {0, m // 2, m - 1}:
            assert torch.equal(cpu_ops.linear(x[i:i + 1], kernel, bias, ops)[0], y[i])
        # lossy: the rounding of x to 8 bits, 0.5-2% of the product here (x's blocks span
        # 100x in magnitude), far above the float32 sums' 1e-7
        exact = x.double() @ w.T
        relative = float((y.double() - bias - exact).norm() / exact.norm())
        assert 1e-4 < relative < 5e-2, relative


def test_the_avx512_and_avx2_builds_give_the_same_bits():
    """The same integers and the same float32 operations per output in both SIMD builds."""
    if runtime_isa() != "avx512":
        pytest.skip("needs a CPU that runs both builds")
    try:
        builds = [importlib.import_module(f"tokenmill._C.cpu_ops_{b}") for b in ("avx512", "avx2")]
    except ImportError:
        pytest.skip("both builds are not installed")
    for type_name in INT8_TYPES:
        kernel = int8_kernel(type_name, 40, 512, seed=7)
        for m in (1, 6, 20):
            x = torch.randn(m, 512)
            ys = [cpu_ops.linear(x, kernel, None, b) for b in builds]
            assert torch.equal(ys[0], ys[1]), (type_name, m)


# The largest pair sums of vpmaddubsw: Q6_K values 0 and 63 (rows 0, 1) times x8 = +-127,
# every int8 scale -128 (bytes 192..207); Q5_K values 0 / 31 with every 6-bit scale 63.
EXTREMES = {
    "Q6_K": (slice(0, 192), 0x00, 0xFF, slice(192, 208), 0x80),
    "Q5_K": (slice(16, 176), 0x00, 0xFF, slice(4, 16), 0xFF),
}


@pytest.mark.parametrize("type_name", list(EXTREMES))
def test_sums_at_their_bound_do_not_saturate(ops, type_name):
    kernel = CPULinearKernel(GGUF_TYPES[type_name].kind, 32,
                             (extreme_rows(type_name, EXTREMES[type_name]),),
                             int8_activations=True)
    x = constant_rows()  # every x8 = +-127
    bias = torch.zeros(3)
    want = expected(x, kernel, bias)
    assert want[:, 1].abs().min() > 1.0  # row 1, the largest values: far from a wrapped sum
    torch.testing.assert_close(cpu_ops.linear(x, kernel, bias, ops), want, rtol=1e-5, atol=1e-4)


# Every int8 K-quant kind in one model: a mixed qkv (Q4_K, Q2_K, Q6_K), a mixed gate_up. And
# the 32-weight kinds served as Q8_0 blocks under int8 activations (GGUFType.int8_as): Q5_0
# and IQ4_NL in o, gate_up and down (qkv keeps float activations: its blocks stay in place).
INT8_FILES = {
    "kquants": {"attn_q": "Q4_K", "attn_k": "Q2_K", "attn_v": "Q6_K", "attn_output": "Q5_K",
                "ffn_gate": "Q3_K", "ffn_up": "Q4_K", "ffn_down": "Q6_K", "token_embd": "Q6_K"},
    "as-q8_0": {"attn_q": "Q5_0", "attn_k": "IQ4_NL", "attn_v": "Q6_K", "attn_output": "Q5_0",
                "ffn_gate": "IQ4_NL", "ffn_up": "Q5_0", "ffn_down": "IQ4_NL",
                "token_embd": "Q8_0"},
}


@pytest.fixture(scope="module", params=list(INT8_FILES))
def int8_file(request, tmp_path_factory, tiny_model, smollm2_path):
    folder, hf = tiny_model("llama-256")
    path = tmp_path_factory.mktemp("kquant-int8") / f"tiny-{request.param}.gguf"
    write_gguf("llama", folder, hf, smollm2_path, path, INT8_FILES[request.param])
    return str(path)


def file_types(path: str) -> dict[str, str]:
    """Tensor name → GGML type name."""
    return {t.name: t.tensor_type.name for t in gguf.GGUFReader(path).tensors}


def held_with_int8(path: str) -> int:
    """The bytes an int8-activation model of the file holds: its tensors as stored, except
    Q5_0 / IQ4_NL ones of the layers with int8 activations (not qkv, the embedding or head),
    held as Q8_0 blocks (34 bytes per 32 weights)."""
    total = 0
    for t in gguf.GGUFReader(path).tensors:
        kind = t.name.split(".")[-2] if t.name.startswith("blk.") else t.name.split(".")[0]
        as_q8_0 = t.tensor_type.name in ("Q5_0", "IQ4_NL") and kind not in (
            "attn_q", "attn_k", "attn_v", "token_embd", "output")
        total += t.n_elements * 34 // 32 if as_q8_0 else t.n_bytes
    return total


def test_a_kquant_model_serves_int8_activations_near_its_float32_expansion(
        int8_file, monkeypatch):
    prompts = [[1, 504, 3458, 282, 4649, 314], list(range(2000, 2040)), [7] * 19]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, prompt_logprobs=0)
    llm = LLM(int8_file, int8_activations=True, max_model_len=256, num_kv_blocks=64)
    model = llm.engine.runner.model
    up = model.model.layers[0].mlp.gate_up_proj
    assert up.quant_method.cpu_kernel(up).int8_activations
    types = file_types(int8_file)
    layer = model.model.layers[0]
    for module, name in [(layer.self_attn.o_proj, "attn_output"), (layer.mlp.down_proj,
                                                                  "ffn_down")]:
        kernel = module.quant_method.cpu_kernel(module)  # Q5_0 / IQ4_NL: as Q8_0 blocks
        kind = block_tiles.BLOCK_KIND.get(kernel.kind, kernel.kind)  # (AMX CPUs: packed)
        assert kind == GGUF_TYPES[types[f"blk.0.{name}.weight"]].served(True)[0].kind
    qkv = layer.self_attn.qkv_proj  # float activations: every part's own blocks
    packed = {k: block_tiles.PACKED_KIND[k] for k in block_tiles.SUPER_BLOCK_TILES
              if cpu_ops.packs_kind(k)}  # the K-quants' tiles where this build has them
    assert [row[0] for row in qkv.quant_method.cpu_kernel(qkv).tensors[0].tolist()] == [
        packed.get(k, k) for k in (GGUF_TYPES[types[f"blk.0.{n}.weight"]].kind
                                   for n in ("attn_q", "attn_k", "attn_v"))]
    held = sum(p.numel() * p.element_size() for p in model.parameters())
    assert held <= held_with_int8(int8_file) * 1.01  # no float copy
    calls: list[int] = []
    real_op = cpu_decode._decode_layers_op()
    monkeypatch.setattr(cpu_decode, "_decode_layers_op",
                        lambda: lambda h, *a: (calls.append(h.shape[0]), real_op(h, *a))[1])
    batched = llm.generate(prompts, params, use_tqdm=False)
    assert calls  # decode steps through the fused call with the int8 kernels
    assert_kv_all_free(llm.engine)
    for prompt, out in zip(prompts, batched, strict=True):  # batch-invariant
        alone = llm.generate([prompt], params, use_tqdm=False)[0]
        assert alone.outputs[0].token_ids == out.outputs[0].token_ids
    # the prompts' logprobs (teacher-forced) against the file's float32 expansion
    dense = LLM(int8_file, quantization="none", max_model_len=256, num_kv_blocks=64)
    reference = dense.generate(prompts, params, use_tqdm=False)
    diffs = [abs(a[t].logprob - b[t].logprob)
             for got, want in zip(batched, reference, strict=True)
             for a, b, t in zip(got.prompt_logprobs[1:], want.prompt_logprobs[1:],
                                got.prompt_token_ids[1:], strict=True)]
    # measured max 0.0065 (K-quants, x per 256) and 0.066 (as Q8_0, x per 32): each layer's
    # error is ~0.5% either way, how far it carries to a logprob differs by model; a wrong
    # weight or rounding moves them by units
    bound = 0.05 if int8_file.endswith("kquants.gguf") else 0.15
    assert 0 < max(diffs) < bound, max(diffs)
