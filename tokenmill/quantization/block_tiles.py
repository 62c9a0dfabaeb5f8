"""Q8_0, 4-bit and GGUF Q4_K blocks packed once at load into tiles of 16 rows (weight kinds
Q8_0_TILES and Q4_TILES, csrc/linear_block_tiles.h) on CPUs that run the AVX-512 VNNI build:
multiplied by AMX-INT8's tile unit where the CPU has it, by vpdpbusd elsewhere (the same bits);
GGUF Q4_K (Q4_K_TILES, csrc/linear_kquant_tiles.h) on the AVX2 and AVX-512 builds (vpdpbusd, or
vpmaddwd on AVX2: the same bits); GGUF Q6_K (Q6_K_TILES, csrc/linear_q6k_tiles.h) on the
AVX-512 VNNI build.

Packing is a permutation of the blocks' bytes and scales, nothing recomputed: 16 rows of W
(a group g) side by side, 4 bytes of each row a time, so that each 32-block of the group is
one B tile of the tile unit's int8 products (and 16 outputs of one vpdpbusd):

    Q8_0:  q (N, K) int8      -> (N/16, K/32, 512): [g, b, 64c + 4j + e] = q[16g + j, 32b + 4c + e]
    4-bit: q (N, K/2) uint8   -> (N/16, K/32, 256): [g, b, 64s + 4j + e] = q[16g + j, 16b + 4s + e]
           (a byte holds weights 32b + 4s + e and 32b + 16 + 4s + e: llama.cpp's nibble order)
    scales d, m (N, groups)   -> (N/16, groups, 16): [g, h, j] = d[16g + j, h]

    Q4_K:  raw super-block rows (N, K/256 * 144) uint8 -> (N/16, K/256, 2368): per group g and
           super-block sb, the 128 nibble bytes of its 16 rows 4 at a time (byte 32j + 4c + e
           of row r at (8j + c) * 64 + 4r + e), then the 6-bit scales and mins one a byte
           ([s][r]), then d[r] and dmin[r] (float16): csrc/linear_kquant_tiles_layout.h's layout.
    Q6_K:  raw super-block rows (N, K/256 * 210) uint8 -> (N/16, K/256, 3360): the ql and qh
           bytes of 16 rows 4 at a time, the int8 scales ([h][r]), d[r]: quantization/
           q6k_tiles.py, csrc/linear_q6k_tiles.h.

Invariant: `unpack(pack(k))` is `k`, bit for bit, so every reader of kinds Q8_0, Q4, Q4_K and
Q6_K (the CUDA GEMM, dequantize) can read a packed weight through `unpack`.
"""

from __future__ import annotations

import torch
from torch import nn

from tokenmill.layers import cpu_ops
from tokenmill.quantization import kquant_tiles, q6k_tiles
from tokenmill.quantization.base import CPULinearKernel
from tokenmill.utils import huge_pages

PACKED_KIND = {CPULinearKernel.Q8_0: CPULinearKernel.Q8_0_TILES,
               CPULinearKernel.Q4: CPULinearKernel.Q4_TILES,
               CPULinearKernel.Q4_K: CPULinearKernel.Q4_K_TILES,
               CPULinearKernel.Q6_K: CPULinearKernel.Q6_K_TILES}
# the K-quants packed by their own modules (a permutation of each super-block's bytes)
SUPER_BLOCK_TILES = {CPULinearKernel.Q4_K: kquant_tiles, CPULinearKernel.Q6_K: q6k_tiles}
BLOCK_KIND = {v: k for k, v in PACKED_KIND.items()}
ROWS, BLOCK = 16, 32


def packs(kernel: CPULinearKernel) -> bool:
    """Whether the loader packs this weight: a Q8_0, 4-bit, Q4_K or Q6_K block weight on the
    CPU, its rows a multiple of 16, where the running build packs its kind (cpu_ops.packs_kind:
    Q8_0, 4-bit and Q6_K on AVX-512 VNNI, Q4_K on AVX2 and AVX-512; the switch
    cpu_ops.block_tiles on). K-quants with int8 activations keep their raw rows (their
    kernels, csrc/linear_gguf_int8.h)."""
    q = kernel.tensors[0]
    if kernel.kind in SUPER_BLOCK_TILES and kernel.int8_activations:
        return False
    return (kernel.kind in PACKED_KIND and q.is_cpu and q.dim() == 2 and q.shape[0] % ROWS == 0
            and kernel.group % BLOCK == 0 and cpu_ops.ops_available()
            and cpu_ops.packs_kind(kernel.kind))


def packed_for(layer: nn.Module, kernel: CPULinearKernel) -> CPULinearKernel:
    """A layer's blocks as the loader holds them: packed where `packs` says so, except in a
    table that is only looked up (`runs_gemm` False: lookups read the stored rows directly)."""
    return pack(kernel) if getattr(layer, "runs_gemm", True) and packs(kernel) else kernel


def held_kind(kind: int, q: torch.Tensor) -> int:
    """The kind of block kind `kind`'s weight whose quantized tensor the layer holds is q:
    packed when q is 3-D (pack's shape), else as stored."""
    return PACKED_KIND[kind] if q.dim() == 3 else kind


def _bytes_per_block(kind: int) -> int:
    return 16 if kind in (CPULinearKernel.Q4, CPULinearKernel.Q4_TILES) else 32


def pack(kernel: CPULinearKernel) -> CPULinearKernel:
    """The weight in its packed kind (module doc); same group, activations and options."""
    if kernel.kind in SUPER_BLOCK_TILES:
        return _with(kernel, PACKED_KIND[kernel.kind],
                     (SUPER_BLOCK_TILES[kernel.kind].pack(kernel.tensors[0]),))
    q, *scales = kernel.tensors
    N, nbytes = q.shape
    per = _bytes_per_block(kernel.kind)
    nb = nbytes // per
    # written once, straight into huge pages: the weights are not copied again into the
    # model's huge-page arena (huge_pages.keep_pages), so each page is touched once at load
    tiles = huge_pages.fresh((N // ROWS, nb, ROWS * per), q.dtype)
    tiles.view(N // ROWS, nb, per // 4, ROWS, 4).copy_(
        q.view(N // ROWS, ROWS, nb, per // 4, 4).permute(0, 2, 3, 1, 4))
    packed = (tiles, *(
        s.view(N // ROWS, ROWS, s.shape[1]).transpose(1, 2).contiguous() for s in scales))
    return _with(kernel, PACKED_KIND[kernel.kind], packed)


def unpack(kernel: CPULinearKernel) -> CPULinearKernel:
    """A packed weight back in its block kind (a copy); any other kernel as it is."""
    if kernel.kind not in BLOCK_KIND:
        return kernel
    if BLOCK_KIND[kernel.kind] in SUPER_BLOCK_TILES:
        kind = BLOCK_KIND[kernel.kind]
        return _with(kernel, kind, (SUPER_BLOCK_TILES[kind].unpack(kernel.tensors[0]),))
    q, *scales = kernel.tensors
    groups, nb, _ = q.shape
    per = _bytes_per_block(kernel.kind)
    rows = q.view(groups, nb, per // 4, ROWS, 4).permute(0, 3, 1, 2, 4)
    unpacked = (rows.reshape(groups * ROWS, nb * per),
                *(s.transpose(1, 2).reshape(groups * ROWS, s.shape[1]) for s in scales))
    return _with(kernel, BLOCK_KIND[kernel.kind], unpacked)


def _with(kernel: CPULinearKernel, kind: int,
          tensors: tuple[torch.Tensor, ...]) -> CPULinearKernel:
    return CPULinearKernel(kind, kernel.group, tuple(t.contiguous() for t in tensors),
                           kernel.int8_activations, kernel.input_scale, kernel.batch_invariant)
