"""TritonPagedAttention: every query of a step attended straight from the paged KV cache by one
Triton kernel (attention/triton_kernels.py), the GPU backend.

A step's queries are cut into tiles: each decode is a tile of one query (launched together,
TILE = 1), and each prefill chunk, over a cached prefix or not, is cut into tiles of
`PREFILL_TILE` consecutive queries (one more launch). A decode's keys are further cut into
splits of `split_keys` keys attended in parallel and merged in order (flash-decoding: a batch
of one sequence of 4k tokens is 8 x Hkv programs instead of Hkv, which leave most of a GPU
idle). The cut is at fixed multiples of split_keys, which depends only on max_model_len
(512 keys, more for contexts over 16k so that a sequence has at most MAX_SPLITS): a
sequence's result never depends on its neighbours, and a sequence of one split computes
exactly what the unsplit kernel would: so an eager step whose decodes all fit one split runs
the unsplit kernel, without the merge's launch. No K/V is gathered into a contiguous
copy: the kernel follows the block tables. This step's k/v are written by one more kernel,
which quantizes them as it writes when the cache is int8 or fp8 (triton_kv_store.store_kv),
and applies the layer's RoPE to q and k in the same launch when the layer hands its tables
over (`forward_rotary`).
Same contract and results as TorchPagedAttention, its oracle
(tests/attention/test_paged_backends.py runs both on the same steps).

On CPU it runs only under TRITON_INTERPRET=1 (Triton's interpreter, for tests), and refuses
otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from tokenmill.attention.base import AttentionBackend, AttentionLayer, DecodeGraphState
from tokenmill.attention.input_batch import InputBatch, tensor_on, to_device
from tokenmill.attention.metadata import AttentionMetadata
from tokenmill.utils import cdiv

PREFILL_TILE = 16
SPLIT_KEYS = 512
MAX_SPLITS = 32
# decode graphs of up to this many rows are also captured unsplit (TritonDecodeGraphState)
ONE_SPLIT_GRAPHS = 16


def split_keys_for(max_model_len: int | None) -> int:
    """Keys per decode split: SPLIT_KEYS, or a multiple of it keeping a sequence of
    max_model_len tokens within MAX_SPLITS splits (bounding the partial sums' memory)."""
    if max_model_len is None:
        return SPLIT_KEYS
    return max(1, cdiv(max_model_len, MAX_SPLITS * SPLIT_KEYS)) * SPLIT_KEYS


@dataclass
class SplitWork:
    """Decode tiles' keys in work items of split_keys keys (a multiple of the kernel's 32-key
    step): item i attends keys [s * split_keys, (s + 1) * split_keys) of tile work_tiles[i],
    s = work_splits[i]; tile t's items are tile_work_start[t] onward, cdiv(keys, split_keys)
    of them, in split order. Items past a tile's keys are padding (a CUDA graph's fixed grid)
    and do nothing. The cut depends on each sequence's length alone: batch-invariant."""

    work_tiles: torch.Tensor  # (W,) int32
    work_splits: torch.Tensor  # (W,) int32
    tile_work_start: torch.Tensor  # (N,) int32
    split_keys: int


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
    split: SplitWork | None = None  # decode tiles: their keys in splits


@dataclass
class TritonAttentionMetadata(AttentionMetadata):
    tiles: list[QueryTiles] = field(default_factory=list)  # one kernel launch each


def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


class TritonPagedAttention(AttentionBackend):
    FEATURES = frozenset({"sliding_window", "soft_cap"})
    def __init__(self, block_size: int, device: torch.device,
                 features: frozenset[str] = frozenset(), max_model_len: int | None = None
                 ) -> None:
        super().__init__(block_size, device, features, max_model_len)
        self.split_keys = split_keys_for(max_model_len)
        if not triton_available():
            raise RuntimeError("attention_backend='triton' needs the triton package "
                               "(it comes with torch's CUDA builds)")
        from tokenmill.attention import triton_kernels, triton_kv_store

        if not triton_kernels.runs_here(device):
            raise RuntimeError(f"the Triton attention kernel does not run on {device}: it "
                               "needs a CUDA device (or TRITON_INTERPRET=1 on CPU, for tests)")
        self._kernels, self._store = triton_kernels, triton_kv_store

    def build_metadata(self, batch: InputBatch) -> TritonAttentionMetadata:
        meta = TritonAttentionMetadata(num_tokens=batch.num_tokens,
                                       slot_mapping=batch.slot_mapping)
        q_lens = np.array(batch.query_lens, dtype=np.int64)
        q_starts = np.array(batch.query_start_locs[:-1], dtype=np.int64)
        # the first query of each sequence sees the cache up to itself
        first_ctx = np.array(batch.seq_lens, dtype=np.int64) - q_lens + 1
        rows = np.arange(len(q_lens))
        decode = q_lens == 1
        if decode.any():
            meta.tiles.append(self._query_tiles(1, np.stack(
                [rows[decode], q_starts[decode], q_lens[decode], first_ctx[decode]]),
                batch.block_tables))
        if not decode.all():  # each longer query in tiles of PREFILL_TILE tokens
            chunked = rows[~decode]
            per_row = -(-q_lens[chunked] // PREFILL_TILE)
            tile_rows = np.repeat(chunked, per_row)
            offsets = PREFILL_TILE * _index_within_runs(per_row)
            meta.tiles.append(self._query_tiles(PREFILL_TILE, np.stack(
                [tile_rows, q_starts[tile_rows] + offsets,
                 np.minimum(PREFILL_TILE, q_lens[tile_rows] - offsets),
                 first_ctx[tile_rows] + offsets]), batch.block_tables))
        keys = first_ctx[decode]
        if keys.size and keys.max() > self.split_keys:
            meta.tiles[0].split = self._split_work(keys)
        # else every decode is one split: the unsplit kernel computes it bit for bit, without
        # the merge's launch (a small batch's graph too: TritonDecodeGraphState.variants)
        return meta

    def _split_work(self, keys: np.ndarray) -> SplitWork:
        """Work items for decode tiles seeing `keys` (N,) int64 keys each (SplitWork)."""
        counts = -(-keys // self.split_keys)
        starts = np.cumsum(counts) - counts
        tiles = np.repeat(np.arange(len(keys)), counts)
        splits = _index_within_runs(counts)
        cols = tensor_on(np.concatenate([tiles, splits, starts]).astype(np.int32),
                         self.device)
        w = len(tiles)
        return SplitWork(cols[:w], cols[w:2 * w], cols[2 * w:], self.split_keys)

    def _query_tiles(self, tile: int, cols: np.ndarray, block_tables: torch.Tensor
                     ) -> QueryTiles:
        """cols (4, N): each tile's row, first query, query count and first context."""
        t = to_device([torch.from_numpy(cols.astype(np.int32))], self.device)[0]
        return QueryTiles(tile=tile, rows=t[0], q_starts=t[1], q_lens=t[2], first_ctx=t[3],
                          block_tables=block_tables)

    def forward(self, layer: AttentionLayer, q: torch.Tensor, k: torch.Tensor,
                v: torch.Tensor, kv_cache: torch.Tensor, meta: TritonAttentionMetadata
                ) -> torch.Tensor:
        self._store.store_kv(kv_cache, k, v, meta.slot_mapping, layer.kv_scales)
        return self._attend(layer, q, kv_cache, meta)

    def fuses_rotary(self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                     sin: torch.Tensor) -> bool:
        return self._store.rotary_fits(q, k, cos, sin)

    def forward_rotary(self, layer: AttentionLayer, q: torch.Tensor, k: torch.Tensor,
                       v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                       kv_cache: torch.Tensor, meta: TritonAttentionMetadata) -> torch.Tensor:
        self._store.rotary_store_kv(q, k, v, cos, sin, kv_cache, meta.slot_mapping,
                                    layer.kv_scales)
        return self._attend(layer, q, kv_cache, meta)

    def _attend(self, layer: AttentionLayer, q: torch.Tensor, kv_cache: torch.Tensor,
                meta: TritonAttentionMetadata) -> torch.Tensor:
        """The step's queries over the cache, which already holds this step's keys."""
        scale, sliding_window, soft_cap = layer.variant  # what the layer computes
        kv_scales = layer.kv_scales
        T, Hq, D = q.shape
        out = torch.empty_like(q)
        for t in meta.tiles:
            self._kernels.paged_attention(q, kv_cache[0], kv_cache[1], out, t.block_tables,
                                          t.rows, t.q_starts, t.q_lens, t.first_ctx, t.tile,
                                          scale, kv_scales, sliding_window, soft_cap, t.split)
        return out.view(T, Hq * D)

    def decode_graph_state(self, max_seqs: int, max_blocks: int) -> TritonDecodeGraphState:
        max_splits = cdiv(max_blocks * self.block_size, self.split_keys)
        return TritonDecodeGraphState(max_seqs, max_blocks, self.device, self.split_keys,
                                      max_splits, self.block_size)


class TritonDecodeGraphState(DecodeGraphState):
    """The decode tile launch (TILE = 1) over static buffers whose metadata is computed on the
    device from the graph's positions and block tables (inside the graph: a step copies only
    its block tables here, its ids and positions to DecodeGraphs). Row i of a graph attends
    block-table row i up to position p_i: first context p_i + 1, this step's slot
    block_tables[i, p_i // block_size] * block_size + p_i % block_size. A padding row
    (position 0, column 0 of its block-table row zeroed) reads and writes slot 0 of the null
    block. The split work is a fixed dense layout: item t * max_splits + s is split s of row t,
    and an item past its row's keys does nothing.

    Variants (a graph each): `True`, that split layout (its merge is one more launch a layer),
    and, for the small batches whose step is mostly launches (up to ONE_SPLIT_GRAPHS rows),
    `False`: the unsplit kernel, replayed only when every row's keys fit one split, where it
    computes the split layout's results bit for bit (the eager rule: build_metadata).
    Without a second split (max_splits 1) there is only `False`."""

    def __init__(self, max_seqs: int, max_blocks: int, device: torch.device, split_keys: int,
                 max_splits: int, block_size: int) -> None:
        i32 = dict(dtype=torch.int32, device=device)
        self.max_blocks, self.block_size = max_blocks, block_size
        self.split_keys, self.max_splits = split_keys, max_splits
        self.block_tables = torch.zeros(max_seqs, max_blocks, dtype=torch.long, device=device)
        self.rows = torch.arange(max_seqs, **i32)  # also each row's query
        self.q_lens = torch.ones(max_seqs, **i32)
        items = torch.arange(max_seqs * max_splits, **i32)
        self.work_tiles, self.work_splits = items // max_splits, items % max_splits
        self.tile_work_start = self.rows * max_splits

    def variants(self, size: int) -> tuple[bool, ...]:
        if self.max_splits == 1:
            return (False,)
        return (False, True) if size <= ONE_SPLIT_GRAPHS else (True,)

    def variant(self, batch: InputBatch, size: int) -> bool:
        # a decode's keys are its seq_len: the cache up to itself
        return (self.max_splits > 1 and (size > ONE_SPLIT_GRAPHS
                                         or max(batch.seq_lens) > self.split_keys))

    def metadata(self, size: int, positions: torch.Tensor, variant: bool = True
                 ) -> TritonAttentionMetadata:
        pos = positions[:size]  # (size,) long
        block = self.block_tables[:size].gather(1, (pos // self.block_size)[:, None])[:, 0]
        slot_mapping = block * self.block_size + pos % self.block_size  # (size,) long
        first_ctx = (pos + 1).to(torch.int32)  # a decode sees the cache up to itself
        split = None
        if variant and self.max_splits > 1:
            items = size * self.max_splits
            split = SplitWork(self.work_tiles[:items], self.work_splits[:items],
                              self.tile_work_start[:size], self.split_keys)
        tiles = QueryTiles(tile=1, rows=self.rows[:size], q_starts=self.rows[:size],
                           q_lens=self.q_lens[:size], first_ctx=first_ctx,
                           block_tables=self.block_tables, split=split)
        return TritonAttentionMetadata(num_tokens=size, slot_mapping=slot_mapping,
                                       tiles=[tiles])

    def load(self, batch: InputBatch, size: int) -> bool:
        n, width = batch.num_tokens, batch.block_tables.shape[1]
        if n != len(batch.query_lens) or width > self.max_blocks:
            return False  # not a plain decode step, or a context longer than the buffers
        self.block_tables[:n, :width].copy_(batch.block_tables)
        self.block_tables[n:size, 0].zero_()  # padding rows: the null block
        return True


def _index_within_runs(lengths: np.ndarray) -> np.ndarray:
    """0, 1, ..., n - 1 for each run length n, concatenated ([2, 3] -> [0, 1, 0, 1, 2])."""
    ends = np.cumsum(lengths)
    return np.arange(ends[-1] if len(ends) else 0) - np.repeat(ends - lengths, lengths)
