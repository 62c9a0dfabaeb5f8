"""GGUF Q5_0 / Q5_1 / IQ4_NL and the K-quants Q2_K .. Q6_K / IQ4_XS served from the file's
own blocks, read in place (csrc/linear_gguf.h): every weight bit for bit as the gguf package
dequantizes it. Products:
on the SIMD builds the activations are rounded to int16 per 256 values (per 32 where K is not
a multiple of 256) and meet the blocks in integers (csrc/linear_gguf_rows.h); the portable
build multiplies exact float32 (the dot kernels); the AVX-512 VNNI build widens the blocks to
int16 weights (K-quant scales folded in) for vpdpwssd (csrc/linear_gguf_vnni.h). Every
installed build is checked. Either way a row's result is bitwise the same at every step size
and in merged layers of mixed types, and a tiny K-quant model's greedy tokens equal its float32
expansion's, logprobs within the rounding's reach, through the fused decode call."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from tests.conftest import assert_kv_all_free
from tests.gguf_writer import write_gguf
from tests.quantization.test_blocks import round_blocks
from tokenmill import LLM, SamplingParams
from tokenmill.bench.real_gguf import random_blocks
from tokenmill.layers import cpu_ops
from tokenmill.models import cpu_decode
from tokenmill.quantization import block_tiles
from tokenmill.quantization.base import CPULinearKernel
from tokenmill.quantization.blocks import dequantize
from tokenmill.quantization.gguf import GGUF_TYPES

pytestmark = pytest.mark.skipif(not cpu_ops.ops_available(), reason="C++ toolchain unavailable")
RAW_TYPES = ["Q5_0", "Q5_1", "IQ4_NL", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_XS"]


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


@pytest.fixture
def ops(cpu_ops_build):
    """Each kernel build this CPU runs (the installed ones): their GGUF kernels differ."""
    return cpu_ops_build


def expected_product(ops, x: torch.Tensor, kernel: CPULinearKernel,
                     bias: torch.Tensor) -> torch.Tensor:
    """What the build computes: dequantize(W) times x rounded as its activations are (to
    int16 per 256 values, per 32 where K is not a multiple of 256; exact on the portable
    build), in float64, so that only the kernel's own float32 sums differ."""
    block = cpu_ops.gguf_activation_block(x.shape[1], ops)
    xr = x if block is None else round_blocks(x, 32767, block)
    return (xr.double() @ dequantize(kernel).double().T + bias.double()).float()


@pytest.mark.parametrize("type_name", RAW_TYPES)
@pytest.mark.parametrize("invariant", [True, False])
@pytest.mark.parametrize("k", [768, 672])
def test_products_are_the_dequantized_weights_times_the_rounded_activations(
        ops, type_name, invariant, k):
    """One kernel per build, so even with batch invariance off a row's result does not depend
    on M: each row of a product is bitwise that row's product alone, at every M (1-4 rows
    decode W as they read it; larger steps decode tiles of it once)."""
    if k % GGUF_TYPES[type_name].weights:
        pytest.skip("K-quant rows are whole 256-weight super-blocks")
    kernel = kernel_of(type_name, 73, k, seed=1)  # odd N: a last row without its pair
    kernel = CPULinearKernel(kernel.kind, 32, kernel.tensors, batch_invariant=invariant)
    bias = torch.randn(73)
    for m in (1, 2, 3, 4, 5, 8, 9, 13, 70):  # raw rows up to 8, tiles above
        x = torch.randn(m, k) * torch.logspace(-1, 1, k)  # blocks of very different ranges
        y = cpu_ops.linear(x, kernel, bias, ops)
        torch.testing.assert_close(y, expected_product(ops, x, kernel, bias), atol=1e-4,
                                   rtol=1e-5)
        for i in {0, m // 2, m - 1}:
            assert torch.equal(cpu_ops.linear(x[i:i + 1], kernel, bias, ops)[0], y[i])
    if cpu_ops.gguf_activation_block(k, ops) is not None:  # int16's rounding, not exact
        w = dequantize(kernel).double()
        exact = x.double() @ w.T
        relative = float((y.double() - bias - exact).norm() / exact.norm())
        assert 1e-7 < relative < 1e-4, relative


@pytest.mark.parametrize("type_name,k", [("Q4_K", 4608), ("Q6_K", 4608), ("Q5_0", 4640)])
def test_a_large_step_in_blocks_of_x_changes_no_row(ops, type_name, k):
    """Large steps take x in blocks of rows (~1 MB: 112 rows at this K), each met by all of a
    thread's tiles of W: 230 rows are two whole blocks and a short one (4640 = 145 blocks of
    32: one dx per 32 values). No row may change."""
    kernel = kernel_of(type_name, 37, k, seed=2)  # tiles of 14 rows and a short last one
    bias = torch.randn(37)
    x = torch.randn(230, k) * torch.logspace(-1, 1, k)
    y = cpu_ops.linear(x, kernel, bias, ops)
    torch.testing.assert_close(y, expected_product(ops, x, kernel, bias), atol=1e-4, rtol=1e-5)
    for i in (0, 111, 112, 200, 229):  # each block's edges
        assert torch.equal(cpu_ops.linear(x[i:i + 1], kernel, bias, ops)[0], y[i])
    assert torch.equal(cpu_ops.linear(x[112:224], kernel, bias, ops), y[112:224])


# Each kind's largest int16 weights (VNNI kernel: sub-block scale times value): bytes of
# W row 0 set to `low`, of row 1 to `high`, the scale bytes to `scale` (each slice of a block).
EXTREMES = {
    # q = 0 (weight -32 sc) and 63 (31 sc), every int8 scale -128: with q not shifted by its
    # zero point first, row 1's 16 * 63 * 128 * 32767 would wrap
    "Q6_K": (slice(0, 192), 0x00, 0xFF, slice(192, 208), 0x80),
    # levels -127 and 113, every 6-bit scale 0 (sc - 32 = -32)
    "IQ4_XS": (slice(8, 136), 0x00, 0xFF, slice(2, 8), 0x00),
}


def extreme_rows(type_name: str, extremes: tuple) -> torch.Tensor:
    """Three rows of 512 weights of `type_name`: row 0's value bytes set to `low`, row 1's to
    `high`, every scale byte to `scale` (extremes: values, low, high, scales, scale)."""
    values, low, high, scales, scale = extremes
    raw = random_blocks(type_name, 3, 512, seed=5)
    blocks = raw.reshape(3, 2, GGUF_TYPES[type_name].nbytes)
    blocks[0, :, values] = low
    blocks[1, :, values] = high
    blocks[:, :, scales] = scale
    return torch.from_numpy(raw)


def constant_rows() -> torch.Tensor:
    """Two rows of x, +0.75 and -0.75: every rounded value at its largest magnitude."""
    x = torch.full((2, 512), 0.75)
    x[1] = -0.75
    return x


@pytest.mark.parametrize("type_name", list(EXTREMES))
def test_sums_at_their_bound_do_not_overflow(ops, type_name):
    """x constant (every x16 = +-32767) against the kind's largest weights: the VNNI kernel's
    int32 lanes then hold up to 16 * 4096 * 32767, just under 2^31."""
    raw = extreme_rows(type_name, EXTREMES[type_name])
    kernel = CPULinearKernel(GGUF_TYPES[type_name].kind, 32, (raw,))
    x = constant_rows()
    bias = torch.zeros(3)
    y = cpu_ops.linear(x, kernel, bias, ops)
    want = expected_product(ops, x, kernel, bias)
    assert want[:, :2].abs().min() > 1.0  # far from any wrapped sum's
    torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("int8_activations", [False, True])
def test_a_merged_layer_is_its_parts_side_by_side(ops, int8_activations):
    """A merged layer's GGUF parts (a Q4_K_M file's Q4_K q / k and Q6_K v, or gate and up)
    share one rounding of x and write their own columns of y on the SIMD builds: bitwise each
    part alone, side by side, at every M (raw rows, tiles, blocks of x) and both roundings."""
    parts = [kernel_of("Q4_K", 64, 512, 2), kernel_of("Q4_K", 32, 512, 3),
             kernel_of("Q6_K", 48, 512, 4)]
    parts = [CPULinearKernel(k.kind, 32, k.tensors, int8_activations) for k in parts]
    meta = torch.tensor([[k.kind, k.group, 1] for k in parts])
    merged = CPULinearKernel(CPULinearKernel.PARTS, 0, (meta, *(k.tensors[0] for k in parts)),
                             int8_activations)
    assert torch.equal(dequantize(merged), torch.cat([dequantize(k) for k in parts]))
    bias = torch.randn(144)
    for m in (1, 4, 9, 40):
        x = torch.randn(m, 512) * torch.logspace(-1, 1, 512)
        try:
            alone = [cpu_ops.linear(x, k, None, ops) for k in parts]
        except RuntimeError as e:  # the portable build has no int8 K-quant kernels
            assert int8_activations and "not implemented" in str(e)
            return
        side_by_side = torch.cat(alone, 1) + bias
        assert torch.equal(cpu_ops.linear(x, merged, bias, ops), side_by_side)


# A Q4_K_M-like file: q and k in Q4_K, v in Q6_K (a mixed qkv), o in Q5_K, gate in Q5_0 and
# up in Q5_1 (a mixed gate_up), down in Q4_K, the tied embedding in Q6_K. A Q2_K-like one:
# the low-bit K-quants and IQ4 in the same places.
KQUANT_FILES = {
    "Q4_K_M": {"attn_q": "Q4_K", "attn_k": "Q4_K", "attn_v": "Q6_K", "attn_output": "Q5_K",
               "ffn_gate": "Q5_0", "ffn_up": "Q5_1", "ffn_down": "Q4_K", "token_embd": "Q6_K"},
    "Q2_K": {"attn_q": "Q2_K", "attn_k": "Q2_K", "attn_v": "Q3_K", "attn_output": "IQ4_XS",
             "ffn_gate": "IQ4_NL", "ffn_up": "Q2_K", "ffn_down": "Q3_K", "token_embd": "IQ4_XS"},
}


@pytest.fixture(scope="module", params=list(KQUANT_FILES))
def kquant_file(request, tmp_path_factory, tiny_model, smollm2_path):
    folder, hf = tiny_model("llama-256")
    path = tmp_path_factory.mktemp("kquant") / f"tiny-{request.param}.gguf"
    write_gguf("llama", folder, hf, smollm2_path, path, KQUANT_FILES[request.param])
    return str(path), KQUANT_FILES[request.param]


def test_a_kquant_model_serves_its_blocks_by_default_like_its_float32_expansion(
        kquant_file, monkeypatch):
    prompts = [[1, 504, 3458, 282, 4649, 314], list(range(2000, 2040))]
    params = SamplingParams(temperature=0, max_tokens=12, logprobs=2, ignore_eos=True)
    path, types = kquant_file
    # a float32 cache as the expansion's (the default is bf16): the weights alone compare
    native = LLM(path, max_model_len=256, num_kv_blocks=64, kv_cache_dtype="float32")
    assert native.engine.config.model.quantization == "gguf"  # the default for these types
    model = native.engine.runner.model
    qkv = model.model.layers[0].self_attn.qkv_proj
    kernel = qkv.quant_method.cpu_kernel(qkv)
    assert kernel.kind == CPULinearKernel.PARTS  # q, k and a v of another type, in place
    # (Q4_K packed into tiles of 16 rows on SIMD builds, Q6_K on AVX-512 VNNI builds:
    # quantization/kquant_tiles.py, q6k_tiles.py)
    packed = {k: block_tiles.PACKED_KIND[k] for k in block_tiles.SUPER_BLOCK_TILES
              if cpu_ops.packs_kind(k)}
    kinds = [GGUF_TYPES[types[t]].kind for t in ("attn_q", "attn_k", "attn_v")]
    assert [row[0] for row in kernel.tensors[0].tolist()] == [packed.get(k, k) for k in kinds]
    held = sum(p.numel() * p.element_size() for p in model.parameters())
    stored = sum(t.n_bytes for t in gguf.GGUFReader(path).tensors)
    assert held <= stored * 1.03  # the file's blocks (Q4_K tiles: 2368 bytes a 2304), no floats
    calls: list[int] = []
    real_op = cpu_decode._decode_layers_op()
    monkeypatch.setattr(cpu_decode, "_decode_layers_op",
                        lambda: lambda h, *a: (calls.append(h.shape[0]), real_op(h, *a))[1])
    outs = native.generate(prompts, params, use_tqdm=False)
    assert calls  # decode steps went through the fused call with the GGUF kernels
    assert_kv_all_free(native.engine)
    dense = LLM(path, quantization="none", max_model_len=256, num_kv_blocks=64)
    expected = dense.generate(prompts, params, use_tqdm=False)
    exact = cpu_ops.gguf_activation_block(256) is None  # the portable build: bitwise
    for got, want in zip(outs, expected, strict=True):
        assert got.outputs[0].token_ids == want.outputs[0].token_ids
        for lp_got, lp_want in zip(got.outputs[0].logprobs, want.outputs[0].logprobs,
                                   strict=True):
            assert lp_got.keys() == lp_want.keys()
            for token, lp in lp_got.items():
                if exact:
                    assert lp == lp_want[token]
                else:  # int16-rounded activations: logprobs within 1e-3
                    assert abs(lp.logprob - lp_want[token].logprob) < 1e-3


def test_int8_activations_are_refused_where_a_type_lacks_them(kquant_file):
    """Both files hold blocks with no int8 kernel (Q5_1, IQ4_XS); the message says which
    types have one (test_gguf_int8.py serves those, Q5_0 / IQ4_NL as Q8_0 blocks)."""
    with pytest.raises(ValueError,
                       match=r"int8_activations is not implemented for GGUF .*\(.*Q4_K.* have it"):
        LLM(kquant_file[0], quantization="gguf", int8_activations=True, max_model_len=64)
