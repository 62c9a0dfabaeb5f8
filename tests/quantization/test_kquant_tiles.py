"""Weight kind Q4_K_TILES (quantization/kquant_tiles.py, csrc/linear_kquant_tiles.h): GGUF Q4_K
super-blocks packed into tiles of 16 rows.

The layout is checked everywhere (a permutation, in torch). The products run on the SIMD
builds (vpdpbusd on AVX-512 VNNI, vpmaddwd on AVX2): checked bit for bit against a
transcription of their definition (x rounded to int16 per 256 values as kind Q4_K's kernels
round it, each sub-block's exact integer sum, then the float32 fmas of the header's table in
order; the fmas emulated in long double, whose 64-bit significand holds each product
exactly), which fixes every rounding, so a row's result does not depend on M, the rows beside
it, the threads or the build; and within x's rounding of the float64 product with gguf's
dequantization."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tokenmill.bench.real_gguf import random_blocks
from tokenmill.layers import cpu_ops
from tokenmill.quantization import block_tiles, kquant_tiles
from tokenmill.quantization.base import CPULinearKernel, merged_kernel
from tokenmill.quantization.blocks import dequantize

Q4_K, Q6_K, TILES = CPULinearKernel.Q4_K, CPULinearKernel.Q6_K, CPULinearKernel.Q4_K_TILES
needs_ops = pytest.mark.skipif(not cpu_ops.ops_available(), reason="C++ toolchain unavailable")
needs_tiles = pytest.mark.skipif(not (cpu_ops.ops_available() and cpu_ops.packs_kind(Q4_K)),
                                 reason="Q4_K tiles need an AVX2 or AVX-512 build")


def raw_q4_k(n: int, k: int, seed: int = 0) -> torch.Tensor:
    return torch.from_numpy(random_blocks("Q4_K", n, k, seed))


def test_packed_layout_as_documented_and_unpack_inverts_it():
    raw = raw_q4_k(48, 512)
    tiles = kquant_tiles.pack(raw)
    assert tiles.shape == (3, 2, 2368)
    blocks = raw.view(48, 2, 144)
    for g, sb, j, c, r, e in [(0, 0, 0, 0, 0, 0), (1, 1, 2, 5, 7, 3), (2, 0, 3, 7, 15, 1)]:
        # nibble byte 32j + 4c + e of row 16g + r's super-block sb
        want = blocks[16 * g + r, sb, 16 + 32 * j + 4 * c + e]
        assert tiles[g, sb, (8 * j + c) * 64 + 4 * r + e] == want
    sc, mn = kquant_tiles._scales_mins(blocks[:, :, 4:16])  # (48, 2, 8)
    assert torch.equal(tiles[1, 1, 2048:2176].view(8, 16), sc[16:32, 1].T)
    assert torch.equal(tiles[1, 1, 2176:2304].view(8, 16), mn[16:32, 1].T)
    assert torch.equal(tiles[2, 0, 2304:2336].view(16, 2), blocks[32:48, 0, 0:2])  # d
    assert torch.equal(tiles[2, 0, 2336:2368].view(16, 2), blocks[32:48, 0, 2:4])  # dmin
    assert torch.equal(kquant_tiles.unpack(tiles), raw)
    k = CPULinearKernel(Q4_K, 32, (raw,))
    packed = block_tiles.pack(k)
    assert packed.kind == TILES and block_tiles.unpack(packed).kind == Q4_K
    assert torch.equal(dequantize(packed), dequantize(k))
    with pytest.raises(ValueError, match="rows in 16s"):
        kquant_tiles.pack(raw[:40])


def test_scales_unpack_as_llama_cpp_and_pack_back_for_any_bytes():
    s12 = torch.randint(0, 256, (1000, 12), dtype=torch.uint8)
    sc, mn = kquant_tiles._scales_mins(s12)
    q = s12.long()
    for j in range(8):  # llama.cpp's get_scale_min_k4
        want_sc = q[:, j] & 63 if j < 4 else (q[:, j + 4] & 0xF) | ((q[:, j - 4] >> 6) << 4)
        want_mn = q[:, j + 4] & 63 if j < 4 else (q[:, j + 4] >> 4) | ((q[:, j] >> 6) << 4)
        assert torch.equal(sc[:, j].long(), want_sc) and torch.equal(mn[:, j].long(), want_mn)
    assert torch.equal(kquant_tiles._packed_scales(sc, mn), s12)


def test_the_loader_packs_float_activations_only():
    k = CPULinearKernel(Q4_K, 32, (raw_q4_k(32, 256),))
    int8 = CPULinearKernel(Q4_K, 32, k.tensors, int8_activations=True)
    assert not block_tiles.packs(int8)  # its int8 kernels read the raw rows
    assert block_tiles.packs(k) == (cpu_ops.ops_available() and cpu_ops.packs_kind(Q4_K))
    assert not block_tiles.packs(CPULinearKernel(Q4_K, 32, (raw_q4_k(40, 256),)))  # 16s only


def _fma(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    ld = np.longdouble
    return (a.astype(ld) * b.astype(ld) + c.astype(ld)).astype(np.float32)


def products_as_defined(x: torch.Tensor, raw: torch.Tensor) -> torch.Tensor:
    """The header's arithmetic (csrc/linear_kquant_tiles_layout.h) for x (M, K), raw Q4_K rows."""
    M, K = x.shape
    N, nsb = raw.shape[0], K // 256
    xb = x.view(M, nsb, 256)
    amax = xb.abs().amax(-1, keepdim=True)
    dx = amax / 32767.0  # float32, as the kernels compute it
    inv = torch.where(dx > 0, 1.0 / dx, torch.zeros_like(dx))
    x16 = (xb * inv).round().to(torch.int64)  # round half to even
    s32 = x16.view(M, nsb, 8, 32).sum(-1).double().numpy().astype(np.float32)  # exact
    blocks = raw.view(N, nsb, 144)
    sc, mn = kquant_tiles._scales_mins(blocks[:, :, 4:16])  # (N, nsb, 8)
    d = blocks[:, :, 0:2].contiguous().view(torch.float16).float().view(N, nsb).numpy()
    dmin = blocks[:, :, 2:4].contiguous().view(torch.float16).float().view(N, nsb).numpy()
    nib = blocks[:, :, 16:].long().view(N, nsb, 4, 32)
    q = torch.stack([nib & 15, nib >> 4], 3).view(N, nsb, 8, 32)  # sub-block 2j, 2j + 1
    # P[m, n, sb, s]: exact integer sums
    P = torch.einsum("nbsk,mbsk->mnbs", q, x16.view(M, nsb, 8, 32)).numpy().astype(np.float32)
    scf, mnf = sc.numpy().astype(np.float32), mn.numpy().astype(np.float32)
    dxf = dx.view(M, nsb).numpy()
    acc = np.zeros((M, N), np.float32)
    for b in range(nsb):
        fs = np.zeros((M, N), np.float32)
        fm = np.zeros((M, N), np.float32)
        for s in range(8):
            fs = _fma(P[:, :, b, s], scf[None, :, b, s], fs)
            fm = _fma(mnf[None, :, b, s], s32[:, None, b, s], fm)
        dd = (d[None, :, b] * dxf[:, None, b]).astype(np.float32)
        dm = (dmin[None, :, b] * -dxf[:, None, b]).astype(np.float32)
        acc = _fma(fm, dm, _fma(fs, dd, acc))
    return torch.from_numpy(acc)


def assert_the_definition_at_every_m(kind: int, raw: torch.Tensor, definition) -> None:
    """A K-quant's raw rows (64 x 768) packed into tiles multiply x as `definition(x, raw)`
    says, bit for bit, at every M, beside any rows, at one thread and two, with a bias; and
    within float32's error of gguf's dequantization times x as rounded. (Shared by the Q4_K
    and Q6_K tiles' tests.)"""
    packed = block_tiles.pack(CPULinearKernel(kind, 32, (raw,)))
    x = torch.randn(11, 768)
    x[3, 5] = 40.0  # an outlier: its block's dx
    x[7, 256:512] = 0.0  # an all-zero block: dx 0
    want = definition(x, raw)
    got = cpu_ops.linear(x, packed)
    assert torch.equal(got, want)
    for m in (1, 2, 3, 4, 5, 8):  # any M, any rows beside it
        assert torch.equal(cpu_ops.linear(x[m:m + m].contiguous(), packed), want[m:m + m])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(cpu_ops.linear(x, packed), want)
    finally:
        torch.set_num_threads(threads)
    # against gguf's dequantization times x as rounded (dx x16): float32's error only
    w = dequantize(CPULinearKernel(kind, 32, (raw,))).double()
    xb = x.view(11, 3, 256)
    dx = xb.abs().amax(-1, keepdim=True) / 32767.0
    x_hat = ((xb / dx).nan_to_num().round() * dx).view(11, 768).double()
    scale = x_hat.abs() @ w.abs().T
    assert ((got.double() - x_hat @ w.T).abs() <= 1e-5 * scale).all()
    bias = torch.randn(64)
    assert torch.equal(cpu_ops.linear(x, packed, bias), want + bias)


@needs_tiles
def test_products_are_the_definition_bit_for_bit_at_every_m():
    assert_the_definition_at_every_m(Q4_K, raw_q4_k(64, 768, seed=3), products_as_defined)


@needs_tiles
def test_the_largest_sums_stay_exact():
    """Every weight 15 and every x at its block's largest magnitude, of either sign: the
    largest integer sums the kernels hold (AVX2's sum of 256 q x16 over a sub-block's 8 chunks
    reaches 2.0e9, under 2^31) are still the definition's."""
    raw = raw_q4_k(16, 512, seed=5).view(16, 2, 144).clone()
    raw[:, :, 16:] = 0xFF  # every nibble 15
    raw = raw.view(16, 288)
    packed = block_tiles.pack(CPULinearKernel(Q4_K, 32, (raw,)))
    x = torch.ones(4, 512)
    x[1] = -1.0
    x[2, ::2] = -1.0  # alternating signs
    x[3, 256:] = -3.0
    assert torch.equal(cpu_ops.linear(x, packed), products_as_defined(x, raw))


@needs_tiles
def test_parts_share_x_and_write_their_own_columns():
    """A merged layer of a packed Q4_K part and a raw Q6_K one (Q4_K_M's qkv): one rounding of
    x, the same bits as each part alone."""
    q4 = block_tiles.pack(CPULinearKernel(Q4_K, 32, (raw_q4_k(32, 512, seed=1),)))
    q6 = CPULinearKernel(Q6_K, 32, (torch.from_numpy(random_blocks("Q6_K", 24, 512, 2)),))
    x = torch.randn(6, 512)
    both = cpu_ops.linear(x, merged_kernel([q4, q6, q4]))
    alone = torch.cat([cpu_ops.linear(x, q4), cpu_ops.linear(x, q6), cpu_ops.linear(x, q4)], 1)
    assert torch.equal(both, alone)


@needs_ops
def test_rows_look_up_from_the_tiles():
    raw = raw_q4_k(32, 512, seed=4)
    k = CPULinearKernel(Q4_K, 32, (raw,))
    ids = torch.tensor([0, 17, 31, 5])
    want = dequantize(k)[ids]
    got = cpu_ops.gather_rows(ids, block_tiles.pack(k))
    assert torch.allclose(got, want, rtol=1e-6, atol=1e-7)
