"""AttentionMetadata: everything attention needs about one step, built once and passed explicitly.

The step's tokens are one flat batch of T tokens (no padding) from B sequences. Sequences whose
query is a single token (decode) are attended in a few batched calls (groups of similar
length); the others (prefill chunks, possibly against cached context) one sequence at a time.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class PrefillSeq:
    """One sequence with q_len > 1. Its queries are tokens [q_start, q_end) of the flat batch."""

    q_start: int
    q_end: int
    context_len: int  # tokens in cache after this step (cached prefix + this chunk)
    block_ids: torch.Tensor | None  # (num_blocks,) long; None when there is no cached prefix
    mask: torch.Tensor | None  # (q_len, context_len) bool, True = attend; None: plain causal


@dataclass
class DecodeGroup:
    """Decode sequences of similar length, attended in one batched call.

    Sequences are sorted by length and split into groups so that padding every row to its
    group's longest context wastes little gather work.
    """

    token_indices: torch.Tensor  # (Bg,) long: positions of their queries in the flat batch
    rows: torch.Tensor  # (Bg,) long: their rows in the batch's block tables
    block_ids: torch.Tensor  # (Bg * max_blocks,) long: block tables, row-major, null-padded
    max_blocks: int
    mask: torch.Tensor  # (Bg, 1, 1, max_blocks * block_size) bool, True = attend
    # Cascade: leading blocks every sequence of the group shares (a cached prefix). When set,
    # block_ids / max_blocks / mask describe only the blocks after them.
    shared_block_ids: torch.Tensor | None = None  # (k,) long


@dataclass
class PagedQueries:
    """Queries attended straight from the paged cache by a kernel (no gathered copy)."""

    token_indices: torch.Tensor  # (N,) long: positions of the queries in the flat batch
    seq_rows: torch.Tensor  # (N,) long: each query's row in block_tables
    start_lens: torch.Tensor  # (N,) long: the first cached token each query attends
    ctx_lens: torch.Tensor  # (N,) long: tokens [start, ctx) of the cache are attended
    block_tables: torch.Tensor  # (B, max_blocks) long


@dataclass
class PrefixCascade:
    """Queries of several sequences whose cached context starts with the same blocks.

    The shared prefix is attended once for all of them (one long query sequence against the
    prefix's keys, no mask) and each query's own part after it by the paged kernel; the two
    are merged through their log-sum-exps. Every shared block lies before each member's first
    query, so no query's own part is empty.
    """

    shared_block_ids: torch.Tensor  # (k,) long
    shared_first_block: int | None  # shared_block_ids[0] when they are consecutive ids
    queries: PagedQueries  # start_lens = k * block_size: each query's part after the prefix


@dataclass
class QueryTiles:
    """Queries cut into tiles of up to `tile` consecutive tokens of one sequence, each tile
    attended straight from the paged cache by one kernel program (causal within the tile)."""

    tile: int
    rows: torch.Tensor  # (N,) int32: each tile's row in block_tables
    q_starts: torch.Tensor  # (N,) int32: flat index of the tile's first query
    q_lens: torch.Tensor  # (N,) int32: queries in the tile, 1..tile
    first_ctx: torch.Tensor  # (N,) int32: cached tokens its first query sees, itself included
    block_tables: torch.Tensor  # (B, max_blocks) long


@dataclass
class AttentionMetadata:
    num_tokens: int
    slot_mapping: torch.Tensor  # (T,) long: the cache slot each new token's K/V is written to
    decode_groups: list[DecodeGroup] = field(default_factory=list)
    prefills: list[PrefillSeq] = field(default_factory=list)
    paged: PagedQueries | None = None  # only backends with a paged kernel set this
    prefix_cascades: list[PrefixCascade] = field(default_factory=list)  # likewise
    tiles: list[QueryTiles] = field(default_factory=list)  # the Triton backend's launches
