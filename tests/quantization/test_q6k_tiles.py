"""Weight kind Q6_K_TILES (quantization/q6k_tiles.py, csrc/linear_q6k_tiles.h): GGUF Q6_K
super-blocks packed into tiles of 16 rows.

The layout is checked everywhere (a permutation, in torch). The products run on the AVX-512
VNNI build: checked bit for bit against a transcription of their definition (x rounded to
int16 per 256 values as kind Q6_K's kernels round it, each 16-weight sub-block's exact integer
sum, then the float32 fmas of the header in order; the fmas emulated in long double, whose
64-bit significand holds each product exactly), which fixes every rounding, so a row's result
does not depend on M, the rows beside it or the threads; and within x's rounding of the
float64 product with gguf's dequantization."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.quantization.test_kquant_tiles import _fma, assert_the_definition_at_every_m
from tokenmill.bench.real_gguf import random_blocks
from tokenmill.layers import cpu_ops
from tokenmill.quantization import block_tiles, q6k_tiles
from tokenmill.quantization.base import CPULinearKernel, merged_kernel
from tokenmill.quantization.blocks import dequantize

Q4_K, Q6_K, TILES = CPULinearKernel.Q4_K, CPULinearKernel.Q6_K, CPULinearKernel.Q6_K_TILES
needs_ops = pytest.mark.skipif(not cpu_ops.ops_available(), reason="C++ toolchain unavailable")
needs_tiles = pytest.mark.skipif(not (cpu_ops.ops_available() and cpu_ops.packs_kind(Q6_K)),
                                 reason="Q6_K tiles need the AVX-512 VNNI build")


def raw_q6_k(n: int, k: int, seed: int = 0) -> torch.Tensor:
    return torch.from_numpy(random_blocks("Q6_K", n, k, seed))


def test_packed_layout_as_documented_and_unpack_inverts_it():
    raw = raw_q6_k(48, 512)
    tiles = q6k_tiles.pack(raw)
    assert tiles.shape == (3, 2, 3360)
    blocks = raw.view(48, 2, 210)
    for g, sb, j, c, r, e in [(0, 0, 0, 0, 0, 0), (1, 1, 2, 5, 7, 3), (2, 0, 3, 7, 15, 1)]:
        # ql byte 32j + 4c + e of row 16g + r's super-block sb
        want = blocks[16 * g + r, sb, 32 * j + 4 * c + e]
        assert tiles[g, sb, (8 * j + c) * 64 + 4 * r + e] == want
    for g, sb, i, c, r, e in [(0, 1, 0, 0, 3, 2), (2, 1, 1, 6, 15, 3)]:  # qh byte 32i + 4c + e
        want = blocks[16 * g + r, sb, 128 + 32 * i + 4 * c + e]
        assert tiles[g, sb, 2048 + (8 * i + c) * 64 + 4 * r + e] == want
    assert torch.equal(tiles[1, 1, 3072:3328].view(16, 16), blocks[16:32, 1, 192:208].T)
    assert torch.equal(tiles[2, 0, 3328:3360].view(16, 2), blocks[32:48, 0, 208:210])  # d
    assert torch.equal(q6k_tiles.unpack(tiles), raw)
    k = CPULinearKernel(Q6_K, 32, (raw,))
    packed = block_tiles.pack(k)
    assert packed.kind == TILES and block_tiles.unpack(packed).kind == Q6_K
    assert torch.equal(dequantize(packed), dequantize(k))
    with pytest.raises(ValueError, match="rows in 16s"):
        q6k_tiles.pack(raw[:40])


def test_the_loader_packs_float_activations_only():
    k = CPULinearKernel(Q6_K, 32, (raw_q6_k(32, 256),))
    int8 = CPULinearKernel(Q6_K, 32, k.tensors, int8_activations=True)
    assert not block_tiles.packs(int8)  # its int8 kernels read the raw rows
    assert block_tiles.packs(k) == (cpu_ops.ops_available() and cpu_ops.packs_kind(Q6_K))
    assert not block_tiles.packs(CPULinearKernel(Q6_K, 32, (raw_q6_k(40, 256),)))  # 16s only


def stored_values(raw: torch.Tensor, nsb: int) -> torch.Tensor:
    """q (N, nsb, 256) int64, 0..63, in weight order (gguf's Q6_K layout)."""
    N = raw.shape[0]
    blocks = raw.view(N, nsb, 210).long()
    ql, qh = blocks[..., :128].view(N, nsb, 2, 64), blocks[..., 128:192].view(N, nsb, 2, 32)
    low = torch.cat([ql & 15, ql >> 4], -1)  # (.., half, 128): u < 64 low nibbles, then high
    high = torch.cat([(qh >> (2 * k)) & 3 for k in range(4)], -1)  # bits 2 (u / 32)
    return (low | (high << 4)).view(N, nsb, 256)


def products_as_defined(x: torch.Tensor, raw: torch.Tensor) -> torch.Tensor:
    """The header's arithmetic (csrc/linear_q6k_tiles.h) for x (M, K), raw Q6_K rows."""
    M, K = x.shape
    N, nsb = raw.shape[0], K // 256
    xb = x.view(M, nsb, 256)
    dx = xb.abs().amax(-1, keepdim=True) / 32767.0  # float32, as the kernels compute it
    inv = torch.where(dx > 0, 1.0 / dx, torch.zeros_like(dx))
    x16 = (xb * inv).round().to(torch.int64)  # round half to even
    q = stored_values(raw, nsb) - 32
    # P[m, n, sb, h]: exact integer sums over each 16-weight sub-block
    P = torch.einsum("nbhk,mbhk->mnbh", q.view(N, nsb, 16, 16), x16.view(M, nsb, 16, 16))
    assert P.abs().max() < 2 ** 24
    P = P.numpy().astype(np.float32)
    blocks = raw.view(N, nsb, 210)
    sc = blocks[..., 192:208].contiguous().view(torch.int8).numpy().astype(np.float32)
    d = blocks[..., 208:210].contiguous().view(torch.float16).float().view(N, nsb).numpy()
    dxf = dx.view(M, nsb).numpy()
    acc = np.zeros((M, N), np.float32)
    for b in range(nsb):
        fs = np.zeros((M, N), np.float32)
        for h in range(16):
            fs = _fma(P[:, :, b, h], sc[None, :, b, h], fs)
        acc = _fma(fs, (d[None, :, b] * dxf[:, None, b]).astype(np.float32), acc)
    return torch.from_numpy(acc)


@needs_tiles
def test_products_are_the_definition_bit_for_bit_at_every_m():
    assert_the_definition_at_every_m(Q6_K, raw_q6_k(64, 768, seed=3), products_as_defined)


@needs_tiles
def test_the_largest_sums_stay_exact():
    """Every weight 63 or every weight 0 (q - 32 at both ends) and every x at its block's
    largest magnitude, of either sign: the largest sums the kernel holds are still the
    definition's."""
    raw = raw_q6_k(32, 512, seed=5).view(32, 2, 210).clone()
    raw[:16, :, :192] = 0xFF  # every q 63
    raw[16:, :, :192] = 0  # every q 0
    raw = raw.view(32, 420)
    packed = block_tiles.pack(CPULinearKernel(Q6_K, 32, (raw,)))
    x = torch.ones(4, 512)
    x[1] = -1.0
    x[2, ::2] = -1.0  # alternating signs
    x[3, 256:] = -3.0
    assert torch.equal(cpu_ops.linear(x, packed), products_as_defined(x, raw))


@needs_tiles
def test_parts_share_x_and_write_their_own_columns():
    """A merged layer of packed Q4_K and Q6_K parts and a raw Q6_K one: one rounding of x, the
    same bits as each part alone."""
    q4 = block_tiles.pack(CPULinearKernel(Q4_K, 32, (torch.from_numpy(
        random_blocks("Q4_K", 32, 512, 1)),)))
    raw6 = CPULinearKernel(Q6_K, 32, (raw_q6_k(24, 512, seed=2),))
    q6 = block_tiles.pack(CPULinearKernel(Q6_K, 32, (raw_q6_k(48, 512, seed=7),)))
    x = torch.randn(6, 512)
    both = cpu_ops.linear(x, merged_kernel([q4, q6, raw6, q6]))
    alone = torch.cat([cpu_ops.linear(x, k) for k in (q4, q6, raw6, q6)], 1)
    assert torch.equal(both, alone)


@needs_ops
def test_rows_look_up_from_the_tiles():
    raw = raw_q6_k(32, 512, seed=4)
    k = CPULinearKernel(Q6_K, 32, (raw,))
    ids = torch.tensor([0, 17, 31, 5])
    want = dequantize(k)[ids]
    got = cpu_ops.gather_rows(ids, block_tiles.pack(k))
    assert torch.allclose(got, want, rtol=1e-6, atol=1e-7)
