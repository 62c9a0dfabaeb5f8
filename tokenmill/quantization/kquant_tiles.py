"""GGUF Q4_K super-blocks packed into tiles of 16 rows, and back (weight kind Q4_K_TILES;
csrc/linear_kquant_tiles_layout.h has the layout and the arithmetic; quantization/block_tiles.py
decides where weights are packed).

A Q4_K super-block (256 weights, 144 bytes) is d, dmin (float16), 12 bytes of 6-bit scales
and mins for its 8 sub-blocks of 32 (llama.cpp's get_scale_min_k4 packing), and 128 bytes
of nibbles: byte 32j + i holds weight 64j + i (sub-block 2j) in its low nibble and weight
64j + 32 + i (sub-block 2j + 1) in its high one. Packing moves the nibble bytes of 16 rows
side by side, 4 bytes a row at a time, and spreads the scales and mins one a byte:

    block (g, sb), 2368 bytes:  [(8j + c) * 64 + 4r + e]  byte 32j + 4c + e of row 16g + r
                                [2048 + 16s + r]          scale of sub-block s of row r
                                [2176 + 16s + r]          its min
                                [2304 + 2r], [2336 + 2r]  d, dmin of row r (float16 bytes)

Invariant: `unpack(pack(raw))` is `raw`, bit for bit (the 6-bit fields are packed back as
llama.cpp packs them).
"""

from __future__ import annotations

import torch

from tokenmill.utils import huge_pages

ROWS, SUPER, RAW_BYTES, PACKED_BYTES = 16, 256, 144, 2368


def _scales_mins(s12: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """12 packed bytes (..., 12) uint8 → the 8 scales and the 8 mins (..., 8) uint8."""
    lo_sc, lo_mn, hi = s12[..., 0:4], s12[..., 4:8], s12[..., 8:12]
    sc = torch.cat([lo_sc & 63, (hi & 15) | ((lo_sc >> 6) << 4)], -1)
    mn = torch.cat([lo_mn & 63, (hi >> 4) | ((lo_mn >> 6) << 4)], -1)
    return sc, mn


def _packed_scales(sc: torch.Tensor, mn: torch.Tensor) -> torch.Tensor:
    """`_scales_mins`'s inverse: (..., 8) scales and mins uint8 → their 12 packed bytes."""
    first = sc[..., :4] | ((sc[..., 4:] >> 4) << 6)
    second = mn[..., :4] | ((mn[..., 4:] >> 4) << 6)
    third = (sc[..., 4:] & 15) | ((mn[..., 4:] & 15) << 4)
    return torch.cat([first, second, third], -1)


def _packed_shape(raw: torch.Tensor) -> tuple[int, int, int]:
    """The tiles' shape for raw Q4_K rows (N, K/256 * 144): (N/16, K/256, 2368)."""
    N, nbytes = raw.shape
    if N % ROWS or nbytes % RAW_BYTES:
        raise ValueError(f"Q4_K tiles need rows in 16s and whole super-blocks; got {N} x "
                         f"{nbytes} bytes")
    return N // ROWS, nbytes // RAW_BYTES, PACKED_BYTES


def pack(raw: torch.Tensor) -> torch.Tensor:
    """Raw Q4_K rows (N, K/256 * 144) uint8, N a multiple of 16 → tiles (N/16, K/256, 2368)."""
    groups, nsb, _ = _packed_shape(raw)
    blocks = raw.reshape(groups, ROWS, nsb, RAW_BYTES)  # [g, r, sb, byte]
    sc, mn = _scales_mins(blocks[..., 4:16])  # [g, r, sb, s]
    out = huge_pages.fresh((groups, nsb, PACKED_BYTES), torch.uint8)  # written once, kept
    # the nibbles moved 4 bytes at a time (as int32: a quarter of the elements to permute)
    words = blocks[..., 16:].contiguous().view(torch.int32).view(groups, ROWS, nsb, 4, 8)
    out[..., :2048].view(torch.int32).view(groups, nsb, 4, 8, ROWS).copy_(
        words.permute(0, 2, 3, 4, 1))  # [g, sb, j, c, r]
    out[..., 2048:2176].view(groups, nsb, 8, ROWS).copy_(sc.permute(0, 2, 3, 1))
    out[..., 2176:2304].view(groups, nsb, 8, ROWS).copy_(mn.permute(0, 2, 3, 1))
    halves = blocks[..., :4].contiguous().view(torch.int16).view(groups, ROWS, nsb, 2)
    out[..., 2304:2368].view(torch.int16).view(groups, nsb, 2, ROWS).copy_(
        halves.permute(0, 2, 3, 1))  # d[r], then dmin[r]
    return out


def unpack(tiles: torch.Tensor) -> torch.Tensor:
    """`pack`'s inverse: tiles (N/16, K/256, 2368) → raw Q4_K rows (N, K/256 * 144)."""
    groups, nsb, nbytes = tiles.shape
    if nbytes != PACKED_BYTES:
        raise ValueError(f"Q4_K tiles hold {PACKED_BYTES} bytes a block, not {nbytes}")
    nibbles = tiles[..., :2048].reshape(groups, nsb, 4, 8, ROWS, 4).permute(0, 4, 1, 2, 3, 5)
    sc = tiles[..., 2048:2176].reshape(groups, nsb, 8, ROWS).permute(0, 3, 1, 2)
    mn = tiles[..., 2176:2304].reshape(groups, nsb, 8, ROWS).permute(0, 3, 1, 2)
    d = tiles[..., 2304:2336].reshape(groups, nsb, ROWS, 2).permute(0, 2, 1, 3)
    dmin = tiles[..., 2336:2368].reshape(groups, nsb, ROWS, 2).permute(0, 2, 1, 3)
    blocks = torch.cat([d, dmin, _packed_scales(sc, mn),
                        nibbles.reshape(groups, ROWS, nsb, 128)], -1)  # [g, r, sb, 144]
    return blocks.reshape(groups * ROWS, nsb * RAW_BYTES).contiguous()
