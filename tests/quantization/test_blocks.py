"""The block layouts (quantization/blocks.py) and the C++ `linear` op that reads them
(csrc/linear_cpu.h): every kind at every batch size equals x @ dequantize(W)^T + bias up to
float32 summation order and the activation rounding each path states; GGUF blocks split bit
for bit into what gguf's own dequantizer gives; quantizers stay within half a step."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tokenmill.layers import cpu_ops
from tokenmill.quantization import CPULinearKernel
from tokenmill.quantization.blocks import dequantize, pack_q4, quantize_q4, quantize_q8_0, unpack_q4
from tokenmill.quantization.gguf import kernel_tensors
from tokenmill.utils.cpp_extension import runtime_isa

pytestmark = pytest.mark.skipif(not cpu_ops.ops_available(), reason="C++ toolchain unavailable")


def random_kernel(kind: int, n: int, k: int, group: int, seed: int) -> CPULinearKernel:
    gen = torch.Generator().manual_seed(seed)
    if kind == CPULinearKernel.Q8_0:
        q = torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8)
        d = (torch.rand(n, k // 32, generator=gen) * 0.02).half()
        return CPULinearKernel(kind, 32, (q, d))
    q = pack_q4(torch.randint(0, 16, (n, k), generator=gen))
    d = (torch.rand(n, k // group, generator=gen) * 0.02).half()
    m = (torch.randn(n, k // group, generator=gen) * 0.05).half()
    return CPULinearKernel(kind, group, (q, d, m))


def round_blocks(x: torch.Tensor, levels: int, block: int = 32) -> torch.Tensor:
    """x rounded per `block` values to integers of +-levels steps, as the kernels do
    (x * (1 / d))."""
    blocks = x.view(x.shape[0], -1, block)
    d = blocks.abs().amax(-1, keepdim=True) / levels
    return (torch.round(blocks * (1 / d)) * d).view_as(x)


def expected_product(x: torch.Tensor, kernel: CPULinearKernel, levels: int | None,
                     bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ dequantize(W)^T (+ bias) with x rounded to `levels` (None: exact), except the 4-bit
    offsets, which multiply the exact sums of x."""
    w = dequantize(kernel)
    offsets = (kernel.tensors[2].float().repeat_interleave(kernel.group, 1)
               if kernel.kind == CPULinearKernel.Q4 else torch.zeros_like(w))
    xr = x if levels is None else round_blocks(x, levels)
    return xr @ (w - offsets).T + x @ offsets.T + (0 if bias is None else bias)


# Float activations: the AVX-512 VNNI build rounds them to int16 per 32-block at every batch
# size (its row kernels, linear_rows_vnni.h, and its GEMM, linear_int8_gemm.h); the others
# are exact (float32 row kernels up to 16 rows, float32 tiles above).
VNNI_BUILD = runtime_isa() == "avx512"


@pytest.mark.parametrize("kind,group", [(CPULinearKernel.Q8_0, 32), (CPULinearKernel.Q4, 32),
                                        (CPULinearKernel.Q4, 64), (CPULinearKernel.Q4, 192)])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 10, 16, 17, 64])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("invariant", [True, False])
def test_linear_equals_dequantized_product(kind, group, m, bias, invariant):
    # n not a multiple of any tile or thread split; k: 18 blocks (16 + 2), or 21 with 4-bit
    # groups of 32 (an odd last block, which the VNNI row kernels take alone and the GEMM's
    # repack transposes alone). Not invariant: from 10 rows the GEMMs of linear_int8_gemm.h
    # (AVX-512 VNNI), float32 tiles from 17 (elsewhere).
    n, k = 300, 672 if group == 32 and kind == CPULinearKernel.Q4 and m % 2 else 576
    kernel = random_kernel(kind, n, k, group, seed=m + group)
    kernel = CPULinearKernel(kind, group, kernel.tensors, batch_invariant=invariant)
    x = torch.randn(m, k) * torch.logspace(-1, 1, k)  # blocks of very different ranges
    b = torch.randn(n) if bias else None
    levels = 32767 if VNNI_BUILD else None
    expected = expected_product(x, kernel, levels, b)
    torch.testing.assert_close(cpu_ops.linear(x, kernel, b), expected, atol=2e-4, rtol=1e-4)
    if levels is not None:  # and the rounding is what it says: 16-bit, not exact
        exact = expected_product(x, kernel, None, b)
        relative = float((exact - expected).norm() / exact.norm())
        assert 1e-8 < relative < 1e-4, relative


def test_gather_rows_and_pack_round_trip():
    kernel = random_kernel(CPULinearKernel.Q4, 50, 96, 32, seed=0)
    ids = torch.tensor([49, 0, 7, 7])
    torch.testing.assert_close(cpu_ops.gather_rows(ids, kernel), dequantize(kernel)[ids])
    values = torch.randint(0, 16, (3, 64))
    assert torch.equal(unpack_q4(pack_q4(values)).long(), values)
    with pytest.raises(RuntimeError, match="row out of range"):
        cpu_ops.gather_rows(torch.tensor([50]), kernel)


def test_nibble_order_is_llama_cpp():
    """Byte j of a block holds weight j (low nibble) and weight j + 16 (high nibble)."""
    values = torch.arange(32).remainder(16).view(1, 32)
    values[0, 16:] = 15 - values[0, 16:]
    packed = pack_q4(values)
    assert [packed[0, j].item() & 0xF for j in range(16)] == list(range(16))
    assert [packed[0, j].item() >> 4 for j in range(16)] == [15 - j for j in range(16)]


def test_quantizers_stay_within_half_a_step():
    w = torch.randn(64, 256) * torch.logspace(-2, 1, 256)  # columns of very different scales
    q, d = quantize_q8_0(w)
    err = (dequantize(CPULinearKernel(CPULinearKernel.Q8_0, 32, (q, d))) - w).abs()
    assert (err <= d.float().repeat_interleave(32, 1) * 0.5 + 1e-6).all()
    kernel = CPULinearKernel(CPULinearKernel.Q4, 32, quantize_q4(w, 32))
    err = (dequantize(kernel) - w).abs()
    step = kernel.tensors[1].float().repeat_interleave(32, 1)
    assert (err <= step * 0.5 + 2e-3 * w.abs().amax(1, keepdim=True)).all()  # + fp16 rounding
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize_q4(w, 48)


@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1", "Q8_0"])
def test_gguf_blocks_split_bit_for_bit(type_name):
    import gguf

    qtype = getattr(gguf.GGMLQuantizationType, type_name)
    w = np.random.default_rng(0).standard_normal((24, 128)).astype(np.float32)
    raw = gguf.quants.quantize(w, qtype)  # (24, bytes per row) uint8, llama.cpp's blocks
    expected = torch.from_numpy(np.ascontiguousarray(gguf.quants.dequantize(raw, qtype)))
    tensors = kernel_tensors(torch.from_numpy(raw), type_name)
    kind, group = (CPULinearKernel.Q8_0, 32) if type_name == "Q8_0" else (CPULinearKernel.Q4, 32)
    kernel = CPULinearKernel(kind, group, tensors)
    assert torch.equal(dequantize(kernel), expected)
    x = torch.randn(2, 128)
    torch.testing.assert_close(cpu_ops.linear(x, kernel),
                               expected_product(x, kernel, 32767 if VNNI_BUILD else None),
                               atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("kind,group", [(CPULinearKernel.Q8_0, 32), (CPULinearKernel.Q4, 32),
                                        (CPULinearKernel.Q4, 64), (CPULinearKernel.Q4, 128)])
@pytest.mark.parametrize("m", [1, 3, 4, 5, 7, 10, 64])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("invariant", [True, False])
def test_int8_activations_round_only_the_activations(kind, group, m, bias, invariant):
    """With int8 activations a product of any size (decode-sized: linear_int8_acts.h; batched:
    linear_int8_gemm.h) equals the float32 one of the same weight on x rounded per 32-block
    (amax / 127 steps), except the 4-bit offsets, which multiply the exact sums of x."""
    # n: a partial group of 16 rows and of 32; k: 36 blocks (16 + 16 + 4), or 37 (odd)
    n, k = 200 if m <= 4 else 305, 1184 if group == 32 and m % 2 else 1152
    kernel = random_kernel(kind, n, k, group, seed=m)
    fast = CPULinearKernel(kind, group, kernel.tensors, int8_activations=True,
                           batch_invariant=invariant)
    x = torch.randn(m, k) * torch.logspace(-1, 1, k)  # blocks of very different ranges
    b = torch.randn(n) if bias else None
    expected = expected_product(x, kernel, 127, b)
    torch.testing.assert_close(cpu_ops.linear(x, fast, b), expected, atol=1e-3, rtol=1e-4)
    assert not torch.allclose(cpu_ops.linear(x, kernel, b), expected, atol=1e-3, rtol=1e-4)


@pytest.mark.parametrize("int8_acts", [True, False])
def test_batched_products_equal_the_decode_kernels(int8_acts):
    """Without batch invariance a step of 64 rows takes the batched kernel (the GEMMs of
    linear_int8_gemm.h on AVX-512 VNNI builds; elsewhere float32 tiles or AVX2's 4-bit GEMM)
    and four rows the decode-sized ones: the same math, up to float32 summation order. Shapes
    where the GEMM's repack meets partial groups of 16 rows, odd block counts and groups of
    2-6 blocks."""
    cases = [(CPULinearKernel.Q8_0, 32, 100, 576), (CPULinearKernel.Q4, 64, 100, 576),
             (CPULinearKernel.Q4, 32, 37, 672), (CPULinearKernel.Q4, 192, 50, 576),
             (CPULinearKernel.Q8_0, 32, 33, 1568)]
    for kind, group, n, k in cases:
        kernel = random_kernel(kind, n, k, group, seed=group + n)
        fast = CPULinearKernel(kind, group, kernel.tensors, int8_activations=int8_acts,
                               batch_invariant=False)
        x = torch.randn(64, k)
        rows = torch.cat([cpu_ops.linear(x[i:i + 4].contiguous(), fast) for i in range(0, 64, 4)])
        torch.testing.assert_close(cpu_ops.linear(x, fast), rows, atol=1e-4, rtol=1e-5)
