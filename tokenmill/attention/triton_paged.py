"""TritonPagedAttention: every query of a step attended straight from the paged KV cache by one
Triton kernel (attention/triton_kernels.py), the GPU backend.

A step's queries are cut into tiles: each decode is a tile of one query (launched together,
TILE = 1), and each prefill chunk, over a cached prefix or not, is cut into tiles of
`PREFILL_TILE` consecutive queries (one more launch). No K/V is gathered into a contiguous
copy: the kernel follows the block tables. Same contract and results as TorchPagedAttention,
its oracle (tests/attention/test_paged_backends.py runs both on the same steps).

On CPU it runs only under TRITON_INTERPRET=1 (Triton's interpreter, for tests), and refuses
otherwise.
"""

from __future__ import annotations

import torch

from tokenmill.attention.base import AttentionBackend
from tokenmill.attention.kv_cache import store_kv
from tokenmill.attention.metadata import AttentionMetadata, QueryTiles
from tokenmill.worker.input_batch import InputBatch

PREFILL_TILE = 16


def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


class TritonPagedAttention(AttentionBackend):
    def __init__(self, block_size: int, device: torch.device) -> None:
        super().__init__(block_size, device)
        if not triton_available():
            raise RuntimeError("attention_backend='triton' needs the triton package "
                               "(it comes with torch's CUDA builds)")
        from tokenmill.attention import triton_kernels

        if not triton_kernels.runs_here(device):
            raise RuntimeError(f"the Triton attention kernel does not run on {device}: it "
                               "needs a CUDA device (or TRITON_INTERPRET=1 on CPU, for tests)")
        self._kernels = triton_kernels

    def build_metadata(self, batch: InputBatch) -> AttentionMetadata:
        meta = AttentionMetadata(num_tokens=batch.num_tokens, slot_mapping=batch.slot_mapping)
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
        return meta

    def _query_tiles(self, tile: int, tiles: list[tuple[int, int, int, int]],
                     block_tables: torch.Tensor) -> QueryTiles:
        cols = torch.tensor(tiles, dtype=torch.int32).T.contiguous()  # (4, N)
        cols = cols.to(self.device, non_blocking=True)
        return QueryTiles(tile=tile, rows=cols[0], q_starts=cols[1], q_lens=cols[2],
                          first_ctx=cols[3], block_tables=block_tables)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        store_kv(kv_cache, k, v, meta.slot_mapping)
        T, Hq, D = q.shape
        out = torch.empty_like(q)
        for t in meta.tiles:
            self._kernels.paged_attention(q, kv_cache[0], kv_cache[1], out, t.block_tables,
                                          t.rows, t.q_starts, t.q_lens, t.first_ctx, t.tile,
                                          scale)
        return out.view(T, Hq * D)
