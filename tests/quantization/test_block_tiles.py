"""Weight kinds Q8_0_TILES and Q4_TILES (quantization/block_tiles.py, csrc/linear_block_tiles.h):
Q8_0 and 4-bit blocks packed into tiles of 16 rows.

The layout is checked everywhere (it is a permutation: pack and unpack in torch). The products
run on the AVX-512 VNNI build: checked bit for bit against a torch transcription of their
definition (x rounded per 32-block, exact integer block sums, then per block one float32 fma
in K order), which fixes every rounding, so the tile unit's path (where the CPU has AMX-INT8)
and the vector rows' path give the same bits and a row's result does not depend on the rows
beside it. Where the CPU has AMX, both paths are checked: the tiles' from 5 rows, and the
vector rows' at every row count with TOKENMILL_AMX=0 in a child process."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from tokenmill.layers import cpu_ops
from tokenmill.quantization import block_tiles
from tokenmill.quantization.base import CPULinearKernel
from tokenmill.quantization.blocks import dequantize, quantize_q4, quantize_q8_0, unpack_q4
from tokenmill.utils.cpp_extension import runtime_isa

Q8, Q4 = CPULinearKernel.Q8_0, CPULinearKernel.Q4
needs_ops = pytest.mark.skipif(not cpu_ops.ops_available(), reason="C++ toolchain unavailable")
needs_tiles = pytest.mark.skipif(not (cpu_ops.ops_available() and cpu_ops.packs_kind(Q8)),
                                 reason="block tiles need the AVX-512 VNNI build")


def blocks(kind: int, n: int, k: int, group: int = 32, seed: int = 0) -> CPULinearKernel:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.05
    tensors = quantize_q8_0(w) if kind == Q8 else quantize_q4(w, group)
    return CPULinearKernel(kind, group, tuple(tensors))


@pytest.mark.parametrize("kind,group", [(Q8, 32), (Q4, 32), (Q4, 128)])
def test_packed_layout_as_documented_and_unpack_inverts_it(kind, group):
    k = blocks(kind, 48, 256, group)
    p = block_tiles.pack(k)
    assert p.kind == block_tiles.PACKED_KIND[kind]
    q, qt = k.tensors[0], p.tensors[0]
    per = 512 if kind == Q8 else 256
    assert qt.shape == (3, 8, per)
    for g, b, c, j, e in [(0, 0, 0, 0, 0), (1, 3, 2, 5, 1), (2, 7, 3, 15, 3)]:
        # 16 rows side by side, 4 bytes of each: row 16g + j's block b, its bytes 4c .. 4c + 3
        assert qt[g, b, 64 * c + 4 * j + e] == q[16 * g + j, b * per // 16 + 4 * c + e]
    for s, st in zip(k.tensors[1:], p.tensors[1:], strict=True):
        assert torch.equal(st[1, :, 5], s[21])
    back = block_tiles.unpack(p)
    assert back.kind == kind and all(torch.equal(a, b) for a, b in
                                     zip(back.tensors, k.tensors, strict=True))
    assert torch.equal(dequantize(p), dequantize(k))


def test_a_large_weights_tiles_are_written_once_into_huge_pages():
    """Packing writes the tiles straight into huge-page memory (huge_pages.fresh), which the
    model keeps where it is: a copy into the weight arena would touch every page again
    (the 1B Q8_0 file's load: 13.1 -> 7.8-9.7 s on the development VM). A small weight's
    tiles are an ordinary allocation. The layout is `pack`'s either way."""
    from tokenmill.utils import huge_pages

    large = blocks(Q8, 2048, 1024)  # 2 MiB of int8 values
    tiles = block_tiles.pack(large).tensors[0]
    assert tiles.data_ptr() % huge_pages.HUGE_PAGE == 0
    assert torch.equal(block_tiles.unpack(block_tiles.pack(large)).tensors[0],
                       large.tensors[0])
    small = block_tiles.pack(blocks(Q8, 64, 256)).tensors[0]
    assert small.untyped_storage().nbytes() == small.numel()  # not a huge-page mapping


@needs_ops
@pytest.mark.parametrize("kind,group", [(Q8, 32), (Q4, 32), (Q4, 128)])
def test_rows_look_up_from_the_tiles(kind, group):
    k = blocks(kind, 64, 256, group, seed=1)
    ids = torch.tensor([0, 17, 63, 17, 40])
    assert torch.equal(cpu_ops.gather_rows(ids, block_tiles.pack(k)), cpu_ops.gather_rows(ids, k))


def test_packs_only_whole_groups_of_rows_where_the_switch_is_on():
    k = blocks(Q8, 40, 64)  # 40 rows: not a multiple of 16
    assert not block_tiles.packs(k)
    if not cpu_ops.ops_available():
        return
    before = cpu_ops.block_tiles(False)
    try:
        assert before  # on by default
        assert not cpu_ops.packs_kind(Q8) and not cpu_ops.packs_kind(CPULinearKernel.Q4_K)
        assert not block_tiles.packs(blocks(Q8, 32, 64))
    finally:
        assert not cpu_ops.block_tiles(before)
    assert block_tiles.packs(blocks(Q8, 32, 64)) == cpu_ops.packs_kind(Q8)
    # Q4_K on every SIMD build (csrc/linear_kquant_tiles.h)
    assert cpu_ops.packs_kind(CPULinearKernel.Q4_K) == (runtime_isa() != "generic")


def rounded(x: torch.Tensor, levels: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x (M, K) as the kernels round it per 32-block: (q (M, K/32, 32) int64, dx (M, K/32))."""
    m, k = x.shape
    xb = x.view(m, k // 32, 32)
    dx = xb.abs().amax(-1) / levels
    inv = torch.where(dx > 0, 1 / dx, torch.zeros(()))
    return torch.round(xb * inv[..., None]).clamp(-levels, levels).long(), dx


def fma(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """float32 a * b + c rounded once (the float64 product of two float32 values is exact)."""
    return (a.double() * b.double() + c.double()).float()


def reference(x: torch.Tensor, k: CPULinearKernel, int8: bool,
              bias: torch.Tensor | None) -> torch.Tensor:
    """The packed kinds' definition (csrc/linear_block_tiles.h) for kernel k in its block kind."""
    m, kk = x.shape
    n, nb, gb = k.tensors[0].shape[0], kk // 32, k.group // 32
    q, dx = rounded(x, 127 if int8 else 32767)
    w = (k.tensors[0] if k.kind == Q8 else unpack_q4(k.tensors[0])).long().view(n, nb, 32)
    sums = torch.einsum("mbk,nbk->mnb", q, w)  # exact int64, each within int32
    d = k.tensors[1].float()
    if k.kind == Q4:  # x's group sums, a float32 loop over each group's values in order
        xg = x.view(m, kk // k.group, k.group)
        xsum = torch.zeros(m, kk // k.group)
        for j in range(k.group):
            xsum = xsum + xg[:, :, j]
    acc = torch.zeros(m, n)
    for b in range(nb):
        acc = fma(sums[:, :, b].float(), d[:, b // gb][None, :] * dx[:, b][:, None], acc)
        if k.kind == Q4 and (b + 1) % gb == 0:
            h = b // gb
            acc = fma(k.tensors[2].float()[:, h][None, :].expand(m, n),
                      xsum[:, h][:, None].expand(m, n), acc)
    return acc if bias is None else acc + bias


@needs_tiles
@pytest.mark.parametrize("int8", [False, True], ids=["int16-x", "int8-x"])
@pytest.mark.parametrize("kind,group", [(Q8, 32), (Q4, 32), (Q4, 128)])
def test_products_follow_their_definition_bit_for_bit(kind, group, int8):
    k = blocks(kind, 48, 384, group, seed=2)
    p = block_tiles.pack(k)
    p = CPULinearKernel(p.kind, group, p.tensors, int8)
    g = torch.Generator().manual_seed(3)
    bias = torch.randn(48, generator=g)
    # the vector rows, whole tiles, a narrower last tile; 700 rows: blocks of x of ~256 KB
    # (336 rows with int16 x, 680 with int8) and a short last block
    for m in (1, 2, 3, 4, 5, 16, 37, 700):
        x = torch.randn(m, 384, generator=g) * 3
        x[0, :32] = 0  # a block of zeros (dx 0)
        assert torch.equal(cpu_ops.linear(x, p, bias), reference(x, k, int8, bias)), m


@needs_tiles
@pytest.mark.parametrize("int8", [False, True], ids=["int16-x", "int8-x"])
@pytest.mark.parametrize("kind", [Q8, Q4])
def test_a_row_alone_equals_the_row_among_others(kind, int8):
    k = block_tiles.pack(blocks(kind, 80, 576, seed=4))
    k = CPULinearKernel(k.kind, 32, k.tensors, int8)
    x = torch.randn(300, 576, generator=torch.Generator().manual_seed(5))
    every = cpu_ops.linear(x, k, None)
    for m in (1, 2, 3, 4, 15, 16, 17, 64):  # each row count's own path and tiling
        assert torch.equal(cpu_ops.linear(x[-m:], k, None), every[-m:]), m
    agree = (every - x @ dequantize(k).T).abs().max() / every.abs().max()
    assert agree < (2e-2 if int8 else 1e-4)  # x's rounding: 8 or 16 bits a block


@pytest.mark.skipif(not (cpu_ops.ops_available() and cpu_ops.block_tiles_amx()),
                    reason="the CPU has no AMX-INT8: the vector rows ran every test above")
def test_the_vector_rows_alone_give_the_same_bits():
    """With the tiles declined (TOKENMILL_AMX=0, read once per process), every row count
    takes the vector rows: this file's product tests pass there too."""
    env = {**os.environ, "TOKENMILL_AMX": "0"}
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          __file__, "-k", "definition or alone_equals"],
                         env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert " passed" in run.stdout and "skipped" not in run.stdout
