"""DecodeGraphs: the model's forward pass for decode batches as CUDA graph replays.

A decode step of B sequences is dominated on a GPU by launching a few hundred small kernels;
replaying a graph captured once launches them all at once. Graphs are captured for a few batch
sizes (`capture_sizes`, the next size up serves a batch), on static buffers: input ids,
positions, the slot mapping, block tables and the Triton backend's decode tiles. A step copies
its inputs into those buffers and replays.

Invariants:
- Only plain decode steps on the Triton backend take this path (one query per sequence, one
  tile launch); anything else runs eagerly, as does every step when no graph fits.
- Rows past B are padding: token 0 at position 0, its K/V written to slot 0 of the null block
  (block 0, never handed out) and attending only that slot, through a block-table row of
  zeros kept past the last real row. A padded row never reads or writes a request's blocks.
- With capture=False the same static buffers and padding run eagerly (no graph): that is how
  the CPU tests check the padding and the buffer handling end to end without a GPU.
"""

from __future__ import annotations

import logging
import time

import torch
from torch import nn

from tokenmill.attention.metadata import AttentionMetadata, QueryTiles
from tokenmill.worker.input_batch import InputBatch

logger = logging.getLogger(__name__)

CAPTURE_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)


class DecodeGraphs:
    def __init__(self, model: nn.Module, device: torch.device, max_num_seqs: int,
                 max_blocks_per_seq: int, capture: bool = True) -> None:
        self.model = model
        self.capture = capture
        self.sizes = [s for s in CAPTURE_SIZES if s <= max_num_seqs] or [1]
        if self.sizes[-1] < max_num_seqs <= CAPTURE_SIZES[-1]:
            self.sizes.append(max_num_seqs)
        n = self.sizes[-1]
        self.max_blocks = max_blocks_per_seq
        long = dict(dtype=torch.long, device=device)
        i32 = dict(dtype=torch.int32, device=device)
        self.input_ids = torch.zeros(n, **long)
        self.positions = torch.zeros(n, **long)
        self.slot_mapping = torch.zeros(n, **long)
        # One row more than any batch: the all-zero (null block) row that padding attends.
        self.block_tables = torch.zeros(n + 1, max_blocks_per_seq, **long)
        self.rows = torch.full((n,), n, **i32)
        self.q_starts = torch.arange(n, **i32)
        self.q_lens = torch.ones(n, **i32)
        self.first_ctx = torch.ones(n, **i32)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.num_replays = 0

    def _meta(self, size: int) -> AttentionMetadata:
        tiles = QueryTiles(tile=1, rows=self.rows[:size], q_starts=self.q_starts[:size],
                           q_lens=self.q_lens[:size], first_ctx=self.first_ctx[:size],
                           block_tables=self.block_tables)
        return AttentionMetadata(num_tokens=size, slot_mapping=self.slot_mapping[:size],
                                 tiles=[tiles])

    def _forward(self, size: int) -> torch.Tensor:
        return self.model(self.input_ids[:size], self.positions[:size], self._meta(size))

    @torch.inference_mode()
    def capture_all(self) -> None:
        """Capture one graph per size, largest first, sharing one memory pool."""
        if not self.capture:
            return
        t0 = time.perf_counter()
        pool = None
        for size in reversed(self.sizes):
            self._forward(size)  # warm-up: Triton compiles, allocator settles
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[size] = self._forward(size)
            pool = graph.pool()
            self.graphs[size] = graph
        torch.cuda.synchronize()
        logger.info("captured %d decode CUDA graphs (batch %d..%d) in %.1f s", len(self.graphs),
                    self.sizes[0], self.sizes[-1], time.perf_counter() - t0)

    def run(self, batch: InputBatch, meta: AttentionMetadata) -> torch.Tensor | None:
        """Final hidden states (n, hidden) of a plain decode step of n sequences, or None:
        run the step eagerly."""
        n = batch.num_tokens
        if (n > self.sizes[-1] or len(meta.tiles) != 1 or meta.tiles[0].tile != 1
                or meta.tiles[0].rows.numel() != n
                or batch.block_tables.shape[1] > self.max_blocks):
            return None
        size = next(s for s in self.sizes if s >= n)
        t = meta.tiles[0]
        self.input_ids[:n].copy_(batch.input_ids)
        self.positions[:n].copy_(batch.positions)
        self.slot_mapping[:n].copy_(batch.slot_mapping)
        width = batch.block_tables.shape[1]
        self.block_tables[:n, :width].copy_(batch.block_tables)
        self.rows[:n].copy_(t.rows)
        self.first_ctx[:n].copy_(t.first_ctx)
        # Padding rows: reset what a larger earlier batch left there.
        self.input_ids[n:size].zero_()
        self.positions[n:size].zero_()
        self.slot_mapping[n:size].zero_()
        self.rows[n:size].fill_(self.block_tables.shape[0] - 1)
        self.first_ctx[n:size].fill_(1)
        self.num_replays += 1
        if not self.capture:
            return self._forward(size)[:n]
        self.graphs[size].replay()
        return self.outputs[size][:n]
