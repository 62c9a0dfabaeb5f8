"""Weight kind BF16_PRODUCTS (csrc/linear_bf16.h): bfloat16 weights multiplied in bfloat16.

Checked bit for bit against a torch transcription of the kernel's definition (x rounded as
torch rounds, each pair's odd product added before its even one, 16 lanes summed in a fixed
tree), which fixes the order of every sum: so the hardware (AVX512-BF16, where this CPU has
it), the emulation and every kernel build this CPU runs give the same bits, and a row's result
does not depend on the rows beside it.

Where the CPU has AMX-BF16 the loader packs such weights for tiles instead (kind BF16_TILES,
csrc/linear_bf16_amx.h), whose order inside a tile product is the hardware's own: those are
checked against the exact product within float32's summation bound, and for batch invariance
bit for bit; kind BF16_PRODUCTS stays vdpbf16ps on the same machine."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys

import pytest
import torch

from tokenmill.layers import cpu_ops
from tokenmill.quantization.base import CPULinearKernel
from tokenmill.utils.cpp_extension import runnable_isas

pytestmark = pytest.mark.skipif(not cpu_ops.ops_available(), reason="C++ toolchain unavailable")
KIND = CPULinearKernel.BF16_PRODUCTS


def reference(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """y (M, N) for x (M, K) float32 and w (N, K) bfloat16, in the kernel's order."""
    m, k = x.shape
    xr = x.to(torch.bfloat16).float().view(m, 1, k // 32, 16, 2)
    wr = w.float().view(1, w.shape[0], k // 32, 16, 2)
    acc = torch.zeros(m, w.shape[0], 16)
    for c in range(k // 32):  # a bf16 product is exact in float32: each + rounds once
        acc = acc + xr[:, :, c, :, 1] * wr[:, :, c, :, 1]
        acc = acc + xr[:, :, c, :, 0] * wr[:, :, c, :, 0]
    t = acc[..., :8] + acc[..., 8:]
    u = t[..., :4] + t[..., 4:]
    y = (u[..., 0] + u[..., 2]) + (u[..., 1] + u[..., 3])
    return y if bias is None else y + bias


def _ops_of(isa: str):
    return importlib.import_module(f"tokenmill._C.cpu_ops_{isa}")


@pytest.fixture(params=runnable_isas())
def ops(request):
    """Each kernel build this CPU runs (installed ones), and on each the paths it has: the
    AVX512-BF16 instructions where this CPU has them, and the float32 emulation."""
    try:
        module = _ops_of(request.param)
    except ImportError:
        pytest.skip(f"the {request.param} build is not installed")
    paths = [True, False] if module.bf16_products_hardware(None) else [False]
    yield module, paths
    module.bf16_products_hardware(True)  # the switch's default


@pytest.mark.parametrize("shape", [(100, 576), (37, 64), (8, 1536)])  # N: 4-row tiles + tails
def test_products_are_the_definition_bit_for_bit(ops, shape):
    module, paths = ops
    n, k = shape
    torch.manual_seed(n)
    w = (torch.randn(n, k) * 0.05).to(torch.bfloat16)
    bias = torch.randn(n)
    for hardware in paths:
        module.bf16_products_hardware(hardware)
        for m in (1, 2, 3, 4, 5, 7, 8, 9, 13, 64, 70, 131):  # tiles of 6 + 0-5 rows
            x = torch.randn(m, k) * 3
            for b in (bias, None):
                got = module.linear(x, KIND, 0, [w], b, False, None, True)
                assert torch.equal(got, reference(x, w, b)), (hardware, m)


def test_a_row_is_the_same_in_any_step(ops):
    """Batch invariance: row 0's output alone and among 200 others, bitwise."""
    module, paths = ops
    w = (torch.randn(96, 256) * 0.05).to(torch.bfloat16)
    x = torch.randn(201, 256)
    for hardware in paths:
        module.bf16_products_hardware(hardware)
        alone = module.linear(x[:1], KIND, 0, [w], None, False, None, True)
        for m in (2, 5, 64, 201):
            assert torch.equal(module.linear(x[:m], KIND, 0, [w], None, False, None, True)[:1],
                               alone)


def test_the_loss_is_the_activations_rounding():
    """Against float32 products of the same weights, the error is that of x in bf16: under
    2^-8 of sum |x w| per output."""
    w = (torch.randn(64, 512) * 0.05).to(torch.bfloat16)
    x = torch.randn(9, 512)
    got = cpu_ops.linear(x, CPULinearKernel(KIND, 0, (w,)))
    exact = x.double() @ w.double().t()
    bound = (x.abs().double() @ w.abs().double().t()) * 2.0 ** -8
    assert ((got.double() - exact).abs() <= bound).all()
    assert not torch.equal(got, (x @ w.float().t()))  # it is not the float32 product


def test_embedding_rows_and_refusals():
    w = (torch.randn(40, 64) * 0.05).to(torch.bfloat16)
    kernel = CPULinearKernel(KIND, 0, (w,))
    rows = torch.tensor([3, 0, 39, 3])
    assert torch.equal(cpu_ops.gather_rows(rows, kernel), w.float()[rows])
    with pytest.raises(RuntimeError, match="bfloat16"):
        cpu_ops.linear(torch.randn(2, 64), CPULinearKernel(KIND, 0, (w.half(),)))
    with pytest.raises(RuntimeError, match="divisible by 32"):
        cpu_ops.linear(torch.randn(2, 48), CPULinearKernel(KIND, 0, (w[:, :48].contiguous(),)))
    with pytest.raises(RuntimeError, match="int8 activations"):
        cpu_ops.linear(torch.randn(2, 64), CPULinearKernel(KIND, 0, (w,), int8_activations=True))


@pytest.fixture
def amx():
    """The AVX-512 build, where this CPU has AMX-BF16 (and Linux granted the tile state)."""
    try:
        module = _ops_of("avx512")
    except ImportError:
        pytest.skip("the avx512 build is not installed")
    if not module.bf16_products_amx(None):
        pytest.skip("this CPU has no AMX-BF16 tiles")
    return module


TILES = CPULinearKernel.BF16_TILES


def test_amx_tiles_pack_w_as_documented(amx):
    """Row 16 g + j's pair p of k at [g, p, j]; the layer's dense view undoes it; shapes that
    do not tile whole are refused."""
    from tokenmill.quantization.unquantized import dense_weight

    w = (torch.randn(48, 96) * 0.05).to(torch.bfloat16)
    t = amx.bf16_tiles(w)
    assert t.shape == (3, 48, 16, 2)
    assert torch.equal(t[2, 7, 5], w[2 * 16 + 5, 14:16])
    assert torch.equal(dense_weight(t), w)
    with pytest.raises(RuntimeError, match="divisible by 16"):
        amx.bf16_tiles(w[:40].contiguous())
    with pytest.raises(RuntimeError, match="kind 16"):
        amx.linear(torch.randn(2, 96), TILES, 0, [w], None, False, None, True)


# N: whole pairs of tiles and a lone one; K: one tile step, odd and even step counts
@pytest.mark.parametrize("shape", [(96, 576), (16, 64), (48, 96), (32, 1536), (1536, 576)])
def test_amx_tiles_are_the_exact_product_within_float32_summation(amx, shape):
    """Each output within K float32 roundings of the exact product of the rounded inputs
    (the worst-case bound of a float32 sum of K products, each exact): the tiles sum every
    product once, the tail rows of x included; not vdpbf16ps's bits (kind BF16_PRODUCTS)."""
    n, k = shape
    torch.manual_seed(n + k)
    w = (torch.randn(n, k) * 0.05).to(torch.bfloat16)
    tiles_w = amx.bf16_tiles(w)
    bias = torch.randn(n)
    for m in (1, 2, 15, 16, 17, 33, 70, 131):
        x = torch.randn(m, k) * 3
        tiles = amx.linear(x, TILES, 0, [tiles_w], bias, False, None, True)
        vdp = amx.linear(x, KIND, 0, [w], bias, False, None, True)
        exact = x.to(torch.bfloat16).double() @ w.double().t() + bias.double()
        bound = (x.to(torch.bfloat16).abs().double() @ w.abs().double().t()) * k * 2.0 ** -24
        assert ((tiles.double() - exact).abs() <= bound + 1e-7).all(), m
        assert ((vdp.double() - exact).abs() <= bound + 1e-7).all(), m
        if k * m * n >= 1536 * 16:  # many outputs: some round differently in the two orders
            assert not torch.equal(tiles, vdp), m


def test_amx_tiles_give_a_row_the_same_bits_in_any_step(amx):
    """Batch invariance on the tiles: a row alone, at any place among up to 400 others (one x
    tile or several, a part tile last), and in a large step's blocks of x, bitwise."""
    w = amx.bf16_tiles((torch.randn(112, 1536) * 0.05).to(torch.bfloat16))
    bias = torch.randn(112)
    x = torch.randn(401, 1536)
    full = amx.linear(x, TILES, 0, [w], bias, False, None, True)  # blocks of 160 rows of x
    for m in (1, 2, 5, 16, 17, 64, 201):
        assert torch.equal(amx.linear(x[:m], TILES, 0, [w], bias, False, None, True), full[:m])
    for i in (0, 15, 16, 100, 170, 400):
        assert torch.equal(amx.linear(x[i:i + 1], TILES, 0, [w], bias, False, None, True),
                           full[i:i + 1])


def test_tokenmill_amx_0_declines_the_tiles(amx):
    """TOKENMILL_AMX=0 (read once per process) leaves the products on vdpbf16ps."""
    code = ("import importlib; m = importlib.import_module('tokenmill._C.cpu_ops_avx512'); "
            "print(m.bf16_products_amx(None), m.bf16_products_hardware(None))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={**os.environ, "TOKENMILL_AMX": "0"}, check=True)
    assert out.stdout.split() == ["False", "True"]


def test_the_start_up_check_agrees_with_the_kernel():
    """config_weights logs "on AMX tiles" from cpp_extension.has_amx_bf16 (the CPU's flags);
    the kernel decides by CPUID and Linux's grant: the two agree here, AMX CPU or not."""
    from tokenmill.utils import cpp_extension

    assert cpp_extension.has_amx_bf16() == cpu_ops.bf16_products_amx()
