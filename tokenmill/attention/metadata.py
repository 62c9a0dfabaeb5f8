"""AttentionMetadata: everything attention needs about one step, built once and passed explicitly.

The step's tokens are one flat batch of T tokens (no padding) from B sequences. Sequences whose
query is a single token (decode) are grouped for one batched attention call; the others
(prefill chunks, possibly against cached context) are handled one sequence at a time.
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
class DecodeBatch:
    """Sequences with a single query token, attended in one batched call."""

    token_indices: torch.Tensor  # (Bd,) long: positions of their queries in the flat batch
    block_tables: torch.Tensor  # (Bd, max_blocks) long, padded with the null block 0
    mask: torch.Tensor  # (Bd, 1, 1, max_blocks * block_size) bool, True = attend
    all_tokens: bool  # True when every token of the step is a decode token (no index_select)


@dataclass
class AttentionMetadata:
    num_tokens: int
    slot_mapping: torch.Tensor  # (T,) long: the cache slot each new token's K/V is written to
    decode: DecodeBatch | None = None
    prefills: list[PrefillSeq] = field(default_factory=list)
