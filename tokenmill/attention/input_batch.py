"""InputBatch: one step's flat token batch, built from the step's requests (resolved by the
runner) with vectorised ops.

For B scheduled sequences with query lengths q_i (T = sum q_i tokens):

    input_ids      (T,)   the tokens fed this step, sequence after sequence
    positions      (T,)   start_pos_i, ..., start_pos_i + q_i - 1 for each sequence
    slot_mapping   (T,)   block_table[pos // block_size] * block_size + pos % block_size
    block_tables   (B, max_blocks)  padded with the null block 0
    query_start_loc (B+1,) prefix sums of q_i
    seq_lens       (B,)   start_pos_i + q_i: the context each query sees
    logits_indices (P,)   the last token of each sequence that samples this step, or with
                          k draft tokens its last k + 1 tokens (the positions verified)
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from tokenmill.core.interface import ScheduledRequest


@dataclass
class InputBatch:
    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens_t: torch.Tensor
    logits_indices: torch.Tensor
    query_lens: list[int]
    query_start_locs: list[int]
    seq_lens: list[int]
    sample_rows: list[int]  # which scheduled sequences sample this step

    @property
    def num_tokens(self) -> int:
        return self.query_start_locs[-1]

    @staticmethod
    def build(reqs: list[ScheduledRequest], block_size: int, device: torch.device
              ) -> InputBatch:
        query_lens = [r.num_tokens for r in reqs]
        starts = [r.start_pos for r in reqs]
        seq_lens = [s + q for s, q in zip(starts, query_lens, strict=True)]
        query_start_locs = [0, *itertools.accumulate(query_lens)]
        sample_rows = [i for i, r in enumerate(reqs) if r.sample]
        # NOTE: numpy reads the Python lists (np.fromiter), ~10 ns an element where
        # torch.tensor takes ~50-180: the block tables of 1,024 running requests were ~9 ms
        # a step of host time from nested lists, ~1 ms this way.
        num_tokens = query_start_locs[-1]
        input_ids = np.fromiter(itertools.chain.from_iterable(r.token_ids for r in reqs),
                                np.int64, num_tokens)
        block_tables = _padded_tables([r.block_ids for r in reqs])  # (B, max_blocks)
        qsl = np.array(query_start_locs, dtype=np.int64)
        start_pos = np.array(starts, dtype=np.int64)
        if num_tokens == len(reqs):  # a decode step: one token per sequence at its start
            row = np.arange(len(reqs))
            positions = start_pos
            logits_indices = np.array(sample_rows, dtype=np.int64)
        else:
            row = np.repeat(np.arange(len(reqs)), query_lens)  # (T,) each token's sequence
            positions = np.arange(num_tokens) - qsl[row] + start_pos[row]
            # each sampling sequence's last num_sample_positions tokens (1, or 1 + drafts)
            logits_indices = np.array(
                [query_start_locs[i + 1] - c + t for i in sample_rows
                 for c in [reqs[i].num_sample_positions] for t in range(c)], dtype=np.int64)
        slots = block_tables[row, positions // block_size] * block_size + positions % block_size
        parts = to_device([torch.from_numpy(a) for a in (
            input_ids, positions, slots, block_tables, qsl,
            np.array(seq_lens, dtype=np.int64), logits_indices)], device)
        return InputBatch(
            input_ids=parts[0], positions=parts[1], slot_mapping=parts[2],
            block_tables=parts[3], query_start_loc=parts[4], seq_lens_t=parts[5],
            logits_indices=parts[6], query_lens=query_lens,
            query_start_locs=query_start_locs, seq_lens=seq_lens, sample_rows=sample_rows)


def _padded_tables(tables: list[list[int]]) -> np.ndarray:
    """(B, longest) int64: each block table, padded with the null block 0."""
    lengths = np.fromiter(map(len, tables), np.int64, len(tables))
    flat = np.fromiter(itertools.chain.from_iterable(tables), np.int64, int(lengths.sum()))
    out = np.zeros((len(tables), int(lengths.max(initial=0))), dtype=np.int64)
    out[np.arange(out.shape[1]) < lengths[:, None]] = flat  # row by row, as flat holds them
    return out


def to_device(tensors: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """Host tensors of one dtype on `device`: on CUDA packed into one pinned buffer and sent
    in one asynchronous copy (one transfer for all; the host does not wait for it, where a
    copy from pageable memory first waits for the stream's queued work), then viewed apart;
    elsewhere as they are."""
    if device.type != "cuda":
        return tensors
    flat = torch.cat([t.reshape(-1) for t in tensors]).pin_memory()
    on_device = flat.to(device, non_blocking=True)
    out, start = [], 0
    for t in tensors:
        out.append(on_device[start:start + t.numel()].view(t.shape))
        start += t.numel()
    return out


def tensor_on(data: Any, device: torch.device, dtype: torch.dtype | None = None
              ) -> torch.Tensor:
    """torch.tensor(data, dtype=dtype) on `device`. On CUDA built in pinned memory and copied
    without blocking the host: torch.tensor(..., device=cuda) copies from pageable memory and
    waits for every kernel queued before it (the step's forward pass), which would stall the
    host's work for the next step (async scheduling) behind this one's."""
    t = torch.tensor(data, dtype=dtype)
    if device.type != "cuda":
        return t if device.type == "cpu" else t.to(device)
    return t.pin_memory().to(device, non_blocking=True)
