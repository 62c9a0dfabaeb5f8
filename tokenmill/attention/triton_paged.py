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
exactly what the unsplit kernel would. No K/V is gathered into a contiguous
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

import torch

from tokenmill.attention.base import AttentionBackend, AttentionLayer, DecodeGraphState
from tokenmill.attention.input_batch import InputBatch, to_device
from tokenmill.attention.metadata import AttentionMetadata
from tokenmill.utils import cdiv

PREFILL_TILE = 16
SPLIT_KEYS = 512
MAX_SPLITS = 32


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
        decode: list[tuple[int, int, int, int]] = []
        chunk: list[tuple[int, int, int, int]] = []
        for i, n in enumerate(batch.query_lens):
            start = batch.query_start_locs[i]
            first_ctx = batch.seq_lens[i] - n + 1  # the first query sees the cache up to itself
            if n == 1:
                decode.append((i, start, 1, first_ctx))
                continue
            for j in range(0, n, PREFILL_TILE):
                chunk.append((i, start + j, min(PREFILL_TILE, n - j), first_ctx + j))
        for tile, tiles in ((1, decode), (PREFILL_TILE, chunk)):
            if tiles:
                meta.tiles.append(self._query_tiles(tile, tiles, batch.block_tables))
        if decode:
            meta.tiles[0].split = self._split_work([first for *_, first in decode])
        return meta

    def _split_work(self, keys: list[int]) -> SplitWork:
        """Work items for decode tiles seeing `keys` keys each (SplitWork)."""
        starts, tiles, splits = [], [], []
        for t, n in enumerate(keys):
            starts.append(len(tiles))
            count = cdiv(n, self.split_keys)
            tiles += [t] * count
            splits += range(count)
        cols = to_device([torch.tensor(tiles + splits + starts, dtype=torch.int32)],
                         self.device)[0]
        w = len(tiles)
        return SplitWork(cols[:w], cols[w:2 * w], cols[2 * w:], self.split_keys)

    def _query_tiles(self, tile: int, tiles: list[tuple[int, int, int, int]],
                     block_tables: torch.Tensor) -> QueryTiles:
        cols = torch.tensor(tiles, dtype=torch.int32).T.contiguous()  # (4, N)
        cols = to_device([cols], self.device)[0]
        return QueryTiles(tile=tile, rows=cols[0], q_starts=cols[1], q_lens=cols[2],
                          first_ctx=cols[3], block_tables=block_tables)

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
                                      max_splits)


class TritonDecodeGraphState(DecodeGraphState):
    """The decode tile launch (TILE = 1) over static buffers: slot mapping, block tables with
    one all-zero row past the last real one (what padding rows attend: the null block), each
    row's block-table row, query start, query length and first context length, and the split
    work items: max_splits per row of the graph's size, those a step does not use doing
    nothing (a split index past every sequence's keys)."""

    def __init__(self, max_seqs: int, max_blocks: int, device: torch.device, split_keys: int,
                 max_splits: int) -> None:
        long = dict(dtype=torch.long, device=device)
        i32 = dict(dtype=torch.int32, device=device)
        self.max_blocks = max_blocks
        self.split_keys, self.max_splits = split_keys, max_splits
        self.slot_mapping = torch.zeros(max_seqs, **long)
        self.block_tables = torch.zeros(max_seqs + 1, max_blocks, **long)
        self.rows = torch.full((max_seqs,), max_seqs, **i32)
        self.q_starts = torch.arange(max_seqs, **i32)
        self.q_lens = torch.ones(max_seqs, **i32)
        self.first_ctx = torch.ones(max_seqs, **i32)
        self.work_tiles = torch.zeros(max_seqs * max_splits, **i32)
        self.work_splits = torch.full((max_seqs * max_splits,), max_splits, **i32)
        self.tile_work_start = torch.zeros(max_seqs, **i32)
        self.row_ids = torch.arange(max_seqs, **i32)

    def metadata(self, size: int) -> TritonAttentionMetadata:
        items = size * self.max_splits
        split = SplitWork(self.work_tiles[:items], self.work_splits[:items],
                          self.tile_work_start[:size], self.split_keys)
        tiles = QueryTiles(tile=1, rows=self.rows[:size], q_starts=self.q_starts[:size],
                           q_lens=self.q_lens[:size], first_ctx=self.first_ctx[:size],
                           block_tables=self.block_tables, split=split)
        return TritonAttentionMetadata(num_tokens=size, slot_mapping=self.slot_mapping[:size],
                                       tiles=[tiles])

    def load(self, batch: InputBatch, meta: TritonAttentionMetadata, size: int) -> bool:
        n = batch.num_tokens
        if (len(meta.tiles) != 1 or meta.tiles[0].tile != 1 or meta.tiles[0].rows.numel() != n
                or batch.block_tables.shape[1] > self.max_blocks):
            return False  # not a plain decode step, or a context longer than the buffers
        t = meta.tiles[0]
        self.slot_mapping[:n].copy_(batch.slot_mapping)
        self.block_tables[:n, :batch.block_tables.shape[1]].copy_(batch.block_tables)
        self.rows[:n].copy_(t.rows)
        self.first_ctx[:n].copy_(t.first_ctx)
        # Padding rows: reset what a larger earlier batch left there.
        self.slot_mapping[n:size].zero_()
        self.rows[n:size].fill_(self.block_tables.shape[0] - 1)
        self.first_ctx[n:size].fill_(1)
        self._load_splits(t.split, n, size)
        return True

    def _load_splits(self, split: SplitWork, n: int, size: int) -> None:
        """The step's work items, then one item per padding row (its one key), then items
        that do nothing up to the graph's size x max_splits."""
        w, pad = split.work_tiles.numel(), size - n
        self.work_tiles[:w].copy_(split.work_tiles)
        self.work_splits[:w].copy_(split.work_splits)
        self.tile_work_start[:n].copy_(split.tile_work_start)
        self.work_tiles[w:w + pad].copy_(self.row_ids[n:size])
        self.work_splits[w:w + pad].zero_()
        self.tile_work_start[n:size].copy_(self.row_ids[:pad] + w)
        self.work_tiles[w + pad:size * self.max_splits].zero_()
        self.work_splits[w + pad:size * self.max_splits].fill_(self.max_splits)
