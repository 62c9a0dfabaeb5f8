"""Cascade planning: which sequences of a step share leading cached blocks (a common prompt
prefix under prefix caching), and whether attending those blocks once for all of them pays,
for torch_ref.py's decode groups (with its `CascadePolicy`). (The C++ kernel backend needs no
plan: its work items read shared blocks once by themselves.)

Invariant of a planned cascade: its k shared blocks lie wholly before every member's first
query of the step (they are cached context), so each member still attends a non-empty part
of its own after them, and the two parts merge exactly through their log-sum-exps.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from tokenmill.attention.input_batch import InputBatch


@dataclass(frozen=True)
class CascadePolicy:
    min_blocks: int = 4  # shared blocks worth a second attention pass
    min_rows: int = 2  # sequences sharing them
    min_queries: int = 4  # queries of those sequences, together
    # a member's queries x its own keys after the prefix, at most (None: no limit); a backend
    # whose own-part path is slow for big chunks keeps them out
    max_own_pairs: int | None = None


@dataclass(frozen=True)
class Cascade:
    rows: list[int]  # the member sequences' rows in the batch
    num_blocks: int  # k: their shared leading blocks


def plan_cascades(batch: InputBatch, block_size: int, rows: Iterable[int],
                  policy: CascadePolicy) -> list[Cascade]:
    """Cascades among `rows`: sequences grouped by their first block, each group sharing the
    longest run of leading blocks that is cached for all of them, kept when `policy` says the
    saving pays."""
    by_first: dict[int, list[int]] = {}
    for i in rows:
        n = batch.query_lens[i]
        cached = batch.seq_lens[i] - n
        if cached < policy.min_blocks * block_size:
            continue
        if policy.max_own_pairs is not None and n * (n + block_size) > policy.max_own_pairs:
            continue
        by_first.setdefault(int(batch.block_tables[i, 0]), []).append(i)
    out = []
    for members in by_first.values():
        if (len(members) < policy.min_rows
                or sum(batch.query_lens[i] for i in members) < policy.min_queries):
            continue
        limit = min((batch.seq_lens[i] - batch.query_lens[i]) // block_size for i in members)
        tables = batch.block_tables[members, :limit]  # (R, limit)
        k = int((tables == tables[:1]).all(dim=0).int().cumprod(dim=0).sum())
        if k < policy.min_blocks:
            continue
        if policy.max_own_pairs is not None and max(
                batch.query_lens[i] * (batch.seq_lens[i] - k * block_size)
                for i in members) > policy.max_own_pairs:
            continue
        out.append(Cascade(members, k))
    return out
