"""DecodeGraphs: the model's forward pass for decode batches as CUDA graph replays.

A decode step of B sequences is dominated on a GPU by launching a few hundred small kernels;
replaying a graph captured once launches them all at once. Graphs are captured for every batch
size vLLM captures (`capture_sizes`: 1, 2, 4, then every 8 up to 256 and every 16 up to 512,
capped at max_num_seqs, which is added; or the sizes asked by vLLM's --cuda-graph-sizes): a
batch takes the next size up, so it pays for at most 7 padding rows up to 256 sequences (15
beyond), under 12% of its rows from 64 on, where the earlier coarse sizes (96, 128, 192, 256)
cost up to a third of a step. Static buffers:
input ids and positions here, and the attention backend's own
(`AttentionBackend.decode_graph_state`: for the Triton backend the block tables, and its
decode tiles in a fixed layout). A step copies its ids, positions and block tables into those
buffers and replays; the metadata derived from them (slots, context lengths) is computed by
ops captured in the graph, so a replayed step builds no metadata on the host. A backend may
capture a size in several layouts (`DecodeGraphState.variants`: the Triton backend's small
batches also without its split-KV merge) and pick one per step (`variant`): a graph per
(size, variant).

Invariants:
- Only backends that provide a graph state take this path, and only for steps their state
  accepts (Triton: plain decode steps, one tile launch); anything else runs eagerly, as does
  every step when no graph fits.
- Rows past B are padding: token 0 at position 0, its K/V written to slot 0 of the null block
  (block 0, never handed out) and attending only that slot (the backend's state sees to the
  attention side). A padded row never reads or writes a request's blocks.
- With capture=False the same static buffers and padding run eagerly (no graph): that is how
  the CPU tests check the padding and the buffer handling end to end without a GPU.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Hashable

import torch
from torch import nn

from tokenmill.attention.base import DecodeGraphState
from tokenmill.attention.input_batch import InputBatch

logger = logging.getLogger(__name__)

CAPTURE_SIZES = (1, 2, 4, *range(8, 257, 8), *range(272, 513, 16))


def default_sizes(limit: int) -> list[int]:
    """vLLM's capture sizes up to `limit`: 1, 2, 4, then every 8 up to 256 and every 16
    beyond; `limit` itself last."""
    sizes = [s for s in (1, 2, 4, *range(8, 257, 8), *range(272, limit + 1, 16)) if s <= limit]
    return sizes if sizes and sizes[-1] == limit else [*sizes, limit]


class DecodeGraphs:
    def __init__(self, model: nn.Module, attention: DecodeGraphState, device: torch.device,
                 max_num_seqs: int, capture: bool = True,
                 asked: tuple[int, ...] | None = None) -> None:
        """`attention`: the backend's state for graphs of up to
        capture_sizes(max_num_seqs, asked)[-1] rows."""
        self.model = model
        self.capture = capture
        self.sizes = self.capture_sizes(max_num_seqs, asked)
        n = self.sizes[-1]
        self.attention = attention
        self.input_ids = torch.zeros(n, dtype=torch.long, device=device)
        self.positions = torch.zeros(n, dtype=torch.long, device=device)
        self.graphs: dict[tuple[int, Hashable], torch.cuda.CUDAGraph] = {}
        self.outputs: dict[tuple[int, Hashable], torch.Tensor] = {}
        self.replays: Counter[tuple[int, Hashable]] = Counter()  # by (size, variant)

    @staticmethod
    def capture_sizes(max_num_seqs: int, asked: tuple[int, ...] | None = None) -> list[int]:
        """The batch sizes graphs are captured for; the last sizes the static buffers.
        Default: vLLM's sizes up to min(max_num_seqs, 512). `asked` (vLLM's
        --cuda-graph-sizes): one value N, vLLM's sizes up to N; several, those sizes. A size
        over max_num_seqs is never captured (no decode step has more rows): max_num_seqs
        takes its place."""
        if asked is None:
            return default_sizes(min(max_num_seqs, CAPTURE_SIZES[-1]))
        if len(asked) == 1:
            return default_sizes(min(max_num_seqs, asked[0]))
        sizes = sorted({s for s in asked if s <= max_num_seqs})
        if max(asked) > max_num_seqs and max_num_seqs not in sizes:
            sizes.append(max_num_seqs)
        return sizes

    @property
    def num_replays(self) -> int:
        return self.replays.total()

    def keys(self) -> list[tuple[int, Hashable]]:
        """(size, variant) of every graph, smallest size first."""
        return [(size, v) for size in self.sizes for v in self.attention.variants(size)]

    def _forward(self, size: int, variant: Hashable) -> torch.Tensor:
        return self.model(self.input_ids[:size], self.positions[:size],
                          self.attention.metadata(size, self.positions, variant))

    @torch.inference_mode()
    def capture_all(self) -> None:
        """Capture one graph per size and variant, largest first, sharing one memory pool."""
        if not self.capture:
            return
        t0 = time.perf_counter()
        pool = None
        for key in reversed(self.keys()):
            self._forward(*key)  # warm-up: Triton compiles, allocator settles
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[key] = self._forward(*key)
            pool = graph.pool()
            self.graphs[key] = graph
        torch.cuda.synchronize()
        logger.info("captured %d decode CUDA graphs (batch %d..%d) in %.1f s", len(self.graphs),
                    self.sizes[0], self.sizes[-1], time.perf_counter() - t0)

    def run(self, batch: InputBatch) -> torch.Tensor | None:
        """Final hidden states (n, hidden) of a plain decode step of n sequences, or None:
        run the step eagerly."""
        n = batch.num_tokens
        if n > self.sizes[-1]:
            return None
        size = next(s for s in self.sizes if s >= n)
        if not self.attention.load(batch, size):
            return None
        self.input_ids[:n].copy_(batch.input_ids)
        self.positions[:n].copy_(batch.positions)
        # Padding rows: reset what a larger earlier batch left there.
        self.input_ids[n:size].zero_()
        self.positions[n:size].zero_()
        key = (size, self.attention.variant(batch, size))
        self.replays[key] += 1
        if not self.capture:
            return self._forward(*key)[:n]
        self.graphs[key].replay()
        return self.outputs[key][:n]
