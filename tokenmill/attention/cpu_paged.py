"""CPUPagedAttention: every query of every step attended straight from the paged KV cache by
one call of a C++ kernel per layer (csrc/paged_attention_cpu.h).

The kernel reads each sequence's cached K/V in place, tile by tile, for decodes and prefill
chunks alike: a chunk's query rows walk their keys together (each tile read, and widened from
a bf16 / int8 / fp8 cache, once for up to 16 rows), and so do rows of sequences whose
contexts start with the same cached blocks (a prompt shared under prefix caching), over those
blocks. It outran every other path it replaced: PyTorch's flash attention for long chunks
(2.5x on a 512-token chunk) and, for shared prefixes, cascades of a flash-attention call over
the prefix merged with the kernel's own parts (1.2x on 64 decodes sharing 1,024 tokens).

Key ranges: a query's keys are cut at the multiples of SPLIT_KEYS and the pieces merged in
order (`split_keys`), so its arithmetic depends on its own position and cache alone: not on
the step's other rows, its chunk or whether its prefix came from the prefix cache. This is
the "batch_invariant" feature (EngineConfig.batch_invariant), and the rule for every step of
`4 x threads` queries or more (the fixed cuts are where shared blocks meet). Outside batch-
invariant mode a step of fewer queries lets the kernel cut each query's keys into equal
parts instead (split_keys 0: flash-decoding, the parts spread over the threads).

A sliding-window layer moves each query's first attended token up to its window's start
(`PagedQueries.first_keys`); a soft cap goes to the kernel as its `soft_cap`. A quantized
cache (int8, fp8 with the layer's kv_scales) is dequantized by the kernel as it reads.

TorchPagedAttention (torch_ref.py) is the oracle this backend is tested against; they share
no attention code.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from tokenmill.attention.base import AttentionBackend, AttentionLayer
from tokenmill.attention.cpu_kernels import paged_attention_op
from tokenmill.attention.input_batch import InputBatch
from tokenmill.attention.kv_cache import store_kv
from tokenmill.attention.metadata import AttentionMetadata

# Queries' keys cut at multiples of this (the unit of parallel work for long contexts; one
# piece below it), in batch-invariant mode and in steps of many queries.
SPLIT_KEYS = 512


@dataclass
class PagedQueries:
    """The step's queries, as the kernel reads them (token t of the flat batch is query t)."""

    seq_rows: torch.Tensor  # (T,) long: each query's row in block_tables
    ctx_lens: torch.Tensor  # (T,) long: cached tokens [0, ctx) are attended (causal)
    block_tables: torch.Tensor  # (B, max_blocks) long
    # > 0: keys cut at its multiples, whatever the step; 0: the kernel balances the call's
    # work over the threads
    split_keys: int = SPLIT_KEYS
    # window → (T,) first attended token, built by the first layer with that window
    _first: dict[int | None, torch.Tensor] = field(default_factory=dict)

    def first_keys(self, window: int | None) -> torch.Tensor:
        """(T,) each query's first attended cached token: 0, or with a sliding window its
        last `window` positions ([ctx - window, ctx), as transformers' mask: keys > its
        position - window). The fused decode call (models/cpu_decode.py) passes these too."""
        if window not in self._first:
            self._first[window] = (torch.zeros_like(self.ctx_lens) if window is None
                                   else (self.ctx_lens - window).clamp_min(0))
        return self._first[window]


@dataclass
class CPUAttentionMetadata(AttentionMetadata):
    paged: PagedQueries | None = None


class CPUPagedAttention(AttentionBackend):
    FEATURES = frozenset({"sliding_window", "soft_cap", "batch_invariant"})

    def __init__(self, block_size: int, device: torch.device,
                 features: frozenset[str] = frozenset(), max_model_len: int | None = None
                 ) -> None:
        super().__init__(block_size, device, features, max_model_len)
        self.invariant = "batch_invariant" in features
        op = paged_attention_op()
        if op is None:
            raise RuntimeError("the CPU paged-attention kernel is not available "
                               "(see the warning above); use attention_backend='torch'")
        self._op = op

    def build_metadata(self, batch: InputBatch) -> CPUAttentionMetadata:
        # query token t (of sequence seq_rows[t], at position p) sees the cache up to itself:
        # p + 1 keys
        seq_rows = np.repeat(np.arange(len(batch.query_lens)), batch.query_lens)
        ctx_lens = batch.positions + 1
        many = len(seq_rows) >= 4 * torch.get_num_threads()
        paged = PagedQueries(seq_rows=torch.from_numpy(seq_rows).to(self.device),
                             ctx_lens=ctx_lens.to(self.device),
                             block_tables=batch.block_tables,
                             split_keys=SPLIT_KEYS if self.invariant or many else 0)
        return CPUAttentionMetadata(num_tokens=batch.num_tokens,
                                    slot_mapping=batch.slot_mapping, paged=paged)

    def forward(self, layer: AttentionLayer, q: torch.Tensor, k: torch.Tensor,
                v: torch.Tensor, kv_cache: torch.Tensor, meta: CPUAttentionMetadata
                ) -> torch.Tensor:
        scale, sliding_window, soft_cap = layer.variant  # what the layer computes
        T, Hq, D = q.shape
        store_kv(kv_cache, k, v, meta.slot_mapping, layer.kv_scales)
        if T == 0:
            return q.new_empty(0, Hq * D)
        p = meta.paged
        out, _ = self._op(q, kv_cache[0], kv_cache[1], p.block_tables, p.seq_rows,
                          p.first_keys(sliding_window), p.ctx_lens, scale, layer.kv_scales,
                          soft_cap or 0.0, p.split_keys)
        return out.view(T, Hq * D)

    def fused_decode_queries(self, meta: CPUAttentionMetadata,
                             num_tokens: int) -> PagedQueries | None:
        """Every step's queries (decodes and prefill chunks) go to the kernel: the fused CPU
        layers call (models/cpu_decode.py) may run it itself."""
        return meta.paged
