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
        max_blocks = max(len(r.block_ids) for r in reqs)
        tables = [r.block_ids + [0] * (max_blocks - len(r.block_ids)) for r in reqs]
        sample_rows = [i for i, r in enumerate(reqs) if r.sample]

        ids = list(itertools.chain.from_iterable(r.token_ids for r in reqs))
        input_ids = torch.tensor(ids, dtype=torch.long)
        block_tables = torch.tensor(tables, dtype=torch.long)  # (B, max_blocks)
        qsl = torch.tensor(query_start_locs, dtype=torch.long)
        if len(ids) == len(reqs):
            # A decode step (one token per sequence): the same values from Python lists, a
            # third of the time of the tensor ops below at batch 1 (the step is then ~20 ms).
            positions = torch.tensor(starts, dtype=torch.long)
            slots = torch.tensor([r.block_ids[p // block_size] * block_size + p % block_size
                                  for r, p in zip(reqs, starts, strict=True)], dtype=torch.long)
            logits_indices = torch.tensor(sample_rows, dtype=torch.long)
        else:
            q_lens = torch.tensor(query_lens, dtype=torch.long)
            row = torch.repeat_interleave(torch.arange(len(reqs)), q_lens)  # (T,) token's seq
            positions = (torch.arange(query_start_locs[-1]) - qsl[row]
                         + torch.tensor(starts, dtype=torch.long)[row])
            slots = (block_tables[row, positions // block_size] * block_size
                     + positions % block_size)
            # each sampling sequence's last num_sample_positions tokens (1, or 1 + drafts)
            logits_indices = torch.tensor(
                [query_start_locs[i + 1] - c + t for i in sample_rows
                 for c in [reqs[i].num_sample_positions] for t in range(c)], dtype=torch.long)
        parts = to_device([input_ids, positions, slots, block_tables, qsl,
                            torch.tensor(seq_lens, dtype=torch.long), logits_indices], device)
        return InputBatch(
            input_ids=parts[0], positions=parts[1], slot_mapping=parts[2],
            block_tables=parts[3], query_start_loc=parts[4], seq_lens_t=parts[5],
            logits_indices=parts[6], query_lens=query_lens,
            query_start_locs=query_start_locs, seq_lens=seq_lens, sample_rows=sample_rows)


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
