"""GGUF Q6_K super-blocks packed into tiles of 16 rows, and back (weight kind Q6_K_TILES;
csrc/linear_q6k_tiles.h has the layout and the arithmetic; quantization/block_tiles.py decides
where weights are packed).

A Q6_K super-block (256 weights, 210 bytes) is 128 bytes of low nibbles (ql), 64 bytes of
high 2-bit pairs (qh), 16 int8 scales (one per 16 weights) and d (float16). Packing moves the
ql and qh bytes of 16 rows side by side, 4 bytes a row at a time, and the scales and d one
row after another:

    block (g, sb), 3360 bytes:  [(8j + c) * 64 + 4r + e]         ql byte 32j + 4c + e of row 16g + r
                                [2048 + (8i + c) * 64 + 4r + e]  qh byte 32i + 4c + e
                                [3072 + 16h + r]                 scale of sub-block h of row r
                                [3328 + 2r]                      d of row r (float16 bytes)

Invariant: `unpack(pack(raw))` is `raw`, bit for bit.
"""

from __future__ import annotations

import torch

from tokenmill.utils import huge_pages

ROWS, SUPER, RAW_BYTES, PACKED_BYTES = 16, 256, 210, 3360
QL, QH, SCALES = 128, 64, 16  # bytes of each part of a raw super-block, in this order, then d


def _packed_shape(raw: torch.Tensor) -> tuple[int, int, int]:
    """The tiles' shape for raw Q6_K rows (N, K/256 * 210): (N/16, K/256, 3360)."""
    N, nbytes = raw.shape
    if N % ROWS or nbytes % RAW_BYTES:
        raise ValueError(f"Q6_K tiles need rows in 16s and whole super-blocks; got {N} x "
                         f"{nbytes} bytes")
    return N // ROWS, nbytes // RAW_BYTES, PACKED_BYTES


def _words(part: torch.Tensor, groups: int, nsb: int) -> torch.Tensor:
    """A part's bytes (g, r, sb, n) as int32 words [g, sb, n / 128, 8, r] (4 bytes a row)."""
    words = part.contiguous().view(torch.int32).view(groups, ROWS, nsb, -1, 8)
    return words.permute(0, 2, 3, 4, 1)


def pack(raw: torch.Tensor) -> torch.Tensor:
    """Raw Q6_K rows (N, K/256 * 210) uint8, N a multiple of 16 → tiles (N/16, K/256, 3360)."""
    groups, nsb, _ = _packed_shape(raw)
    blocks = raw.reshape(groups, ROWS, nsb, RAW_BYTES)  # [g, r, sb, byte]
    out = huge_pages.fresh((groups, nsb, PACKED_BYTES), torch.uint8)  # written once, kept
    sc0, d0 = QL + QH, QL + QH + SCALES
    out[..., :2048].view(torch.int32).view(groups, nsb, 4, 8, ROWS).copy_(
        _words(blocks[..., :QL], groups, nsb))
    out[..., 2048:3072].view(torch.int32).view(groups, nsb, 2, 8, ROWS).copy_(
        _words(blocks[..., QL:sc0], groups, nsb))
    out[..., 3072:3328].view(groups, nsb, SCALES, ROWS).copy_(
        blocks[..., sc0:d0].permute(0, 2, 3, 1))
    out[..., 3328:].view(torch.int16).view(groups, nsb, ROWS).copy_(
        blocks[..., d0:].contiguous().view(torch.int16).view(groups, ROWS, nsb).permute(0, 2, 1))
    return out


def unpack(tiles: torch.Tensor) -> torch.Tensor:
    """`pack`'s inverse: tiles (N/16, K/256, 3360) → raw Q6_K rows (N, K/256 * 210)."""
    groups, nsb, nbytes = tiles.shape
    if nbytes != PACKED_BYTES:
        raise ValueError(f"Q6_K tiles hold {PACKED_BYTES} bytes a block, not {nbytes}")
    ql = tiles[..., :2048].reshape(groups, nsb, 4, 8, ROWS, 4).permute(0, 4, 1, 2, 3, 5)
    qh = tiles[..., 2048:3072].reshape(groups, nsb, 2, 8, ROWS, 4).permute(0, 4, 1, 2, 3, 5)
    sc = tiles[..., 3072:3328].reshape(groups, nsb, SCALES, ROWS).permute(0, 3, 1, 2)
    d = tiles[..., 3328:].reshape(groups, nsb, ROWS, 2).permute(0, 2, 1, 3)
    blocks = torch.cat([ql.reshape(groups, ROWS, nsb, QL), qh.reshape(groups, ROWS, nsb, QH),
                        sc, d], -1)  # [g, r, sb, 210]
    return blocks.reshape(groups * ROWS, nsb * RAW_BYTES).contiguous()
