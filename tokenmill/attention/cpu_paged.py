"""CPUPagedAttention: decode and short chunks attended straight from the paged KV cache by a
C++ kernel, and shared cached prefixes attended once per step (cascade attention).

Which path each query takes in a step:
- sequences whose cached context starts with the same blocks (prefix caching: one system
  prompt, many requests; planned by attention/cascade.py) form a cascade: the shared prefix
  is attended once for all their queries, decode tokens and prefill chunks alike, by
  PyTorch's fused CPU flash-attention op (one long query sequence per KV head against the
  prefix, no mask; it also returns the log-sum-exp), and each query's own part after the
  prefix by the kernel; the two are merged through their log-sum-exps. Attending the prefix
  per sequence would read it once per sequence, and a masked per-sequence SDPA call over it
  runs at ~3/4 of the unmasked rate. A prefix whose blocks are consecutive in the pool is
  read as a view of the cache, no copy;
- other decode queries and short chunks (at most `_KERNEL_MAX_QUERY` tokens: speculative
  verification, a prompt's tail) go to the kernel (csrc/paged_attention_cpu.cpp), one call
  for all of them: it reads each sequence's cached K/V once, in place;
- longer prefill chunks keep the PyTorch path: they are GEMM-bound, and gathering their cached
  context once costs little next to q_len x context attention math.

Batch-invariant (the "batch_invariant" feature, EngineConfig.batch_invariant): no cascades and
no PyTorch path; every query of every step goes to the kernel, which cuts each query's keys at
fixed multiples of INVARIANT_SPLIT_KEYS and merges the pieces in order (`split_keys`), so a
query's arithmetic depends on its own position and cache alone: not on the step's other rows,
its chunk or whether its prefix came from the prefix cache.

A sliding-window layer moves each kernel query's first attended token up to its window's start
(the kernel's `start_lens`); a soft cap goes to the kernel as its `soft_cap` (cap tanh(s / cap)
on every score before the softmax), and to the PyTorch path of long chunks.

Same contract and results as TorchPagedAttention (its oracle): float32 queries, a KV cache in
any format of kv_cache.py (the kernel dequantizes int8 / fp8 rows as it reads them; a cascade's
shared prefix is dequantized once for SDPA).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tokenmill.attention.base import AttentionLayer
from tokenmill.attention.cascade import CascadePolicy, plan_cascades
from tokenmill.attention.cpu_kernels import paged_attention_op
from tokenmill.attention.input_batch import InputBatch
from tokenmill.attention.kv_cache import as_float, store_kv
from tokenmill.attention.torch_ref import (
    TorchAttentionMetadata,
    TorchPagedAttention,
    merge_by_lse,
)

_KERNEL_MAX_QUERY = 8
# Batch-invariant steps: each query's keys in pieces cut at multiples of this (the unit of
# parallel work for long contexts; one piece below it).
INVARIANT_SPLIT_KEYS = 512
# A cascade: 2+ sequences sharing 4+ blocks, 4+ queries in all; a chunk joins only if the
# kernel's share stays small, its query x key pairs after the prefix (the kernel walks them one
# query at a time; SDPA is faster for big chunks).
CASCADE_POLICY = CascadePolicy(min_blocks=4, min_rows=2, min_queries=4,
                               max_own_pairs=64 * 256)


@dataclass
class PagedQueries:
    """Queries attended straight from the paged cache by the kernel (no gathered copy)."""

    token_indices: torch.Tensor  # (N,) long: positions of the queries in the flat batch
    seq_rows: torch.Tensor  # (N,) long: each query's row in block_tables
    start_lens: torch.Tensor  # (N,) long: the first cached token each query attends
    ctx_lens: torch.Tensor  # (N,) long: tokens [start, ctx) of the cache are attended
    block_tables: torch.Tensor  # (B, max_blocks) long
    # > 0: keys cut at its multiples, whatever the step (batch invariance); 0: the kernel
    # balances the call's work over the threads
    split_keys: int = 0

    def first_keys(self, window: int | None) -> torch.Tensor:
        """(N,) each query's first attended cached token: start_lens, or with a sliding
        window its last `window` positions ([ctx - window, ctx), as transformers' mask: keys
        > its position - window; windowed layers have no cascades). The fused decode call
        (models/cpu_decode.py) starts its kernel walk by this rule too."""
        return self.start_lens if window is None else (self.ctx_lens - window).clamp_min(0)


@dataclass
class PrefixCascade:
    """Queries of several sequences whose cached context starts with the same blocks.

    The shared prefix is attended once for all of them (one long query sequence against the
    prefix's keys, no mask) and each query's own part after it by the paged kernel; the two
    are merged through their log-sum-exps. Every shared block lies before each member's first
    query, so no query's own part is empty.
    """

    shared_block_ids: torch.Tensor  # (k,) long
    shared_first_block: int | None  # shared_block_ids[0] when they are consecutive ids
    queries: PagedQueries  # start_lens = k * block_size: each query's part after the prefix


@dataclass
class CPUAttentionMetadata(TorchAttentionMetadata):
    """`prefills` (inherited) for long chunks; no decode groups: cascades replace them."""

    paged: PagedQueries | None = None  # the kernel's queries outside cascades
    prefix_cascades: list[PrefixCascade] = field(default_factory=list)


class CPUPagedAttention(TorchPagedAttention):
    FEATURES = frozenset({"sliding_window", "soft_cap", "batch_invariant"})

    def __init__(self, block_size: int, device: torch.device,
                 features: frozenset[str] = frozenset()) -> None:
        super().__init__(block_size, device, features)
        self.invariant = "batch_invariant" in features
        self.cascades = self.cascades and not self.invariant
        op = paged_attention_op()
        if op is None:
            raise RuntimeError("the CPU paged-attention kernel is not available "
                               "(see the warning above); use attention_backend='torch'")
        self._op = op

    # ---- metadata ---------------------------------------------------------------------------
    def build_metadata(self, batch: InputBatch) -> CPUAttentionMetadata:
        meta = CPUAttentionMetadata(num_tokens=batch.num_tokens,
                                    slot_mapping=batch.slot_mapping)
        in_cascade: set[int] = set()
        cascades = (plan_cascades(batch, self.block_size, range(len(batch.query_lens)),
                                  CASCADE_POLICY) if self.cascades else [])
        for c in cascades:
            queries = self._paged_queries(batch, c.rows, c.num_blocks * self.block_size)
            shared = batch.block_tables[c.rows[0], :c.num_blocks]
            meta.prefix_cascades.append(
                PrefixCascade(shared, _first_if_consecutive(shared), queries))
            in_cascade.update(c.rows)
        # Everything else, in flat-batch order: when every query of the step goes to the
        # kernel they are exactly tokens 0..T-1, and forward passes q through without a gather.
        kernel_rows = []
        for i, n in enumerate(batch.query_lens):
            if i in in_cascade:
                continue
            if n > _KERNEL_MAX_QUERY and not self.invariant:
                meta.prefills.append(self._prefill_seq(batch, i))
            else:
                kernel_rows.append(i)
        if kernel_rows:
            meta.paged = self._paged_queries(batch, kernel_rows, 0)
        return meta

    def _paged_queries(self, batch: InputBatch, rows: list[int], start: int) -> PagedQueries:
        """Every query of `rows`, each attending cached tokens [start, its own position]."""
        tokens: list[int] = []
        seq_rows: list[int] = []
        ctx_lens: list[int] = []
        for i in rows:
            n = batch.query_lens[i]
            first_ctx = batch.seq_lens[i] - n + 1  # query j sees the cache up to itself
            tokens += range(batch.query_start_locs[i], batch.query_start_locs[i + 1])
            seq_rows += [i] * n
            ctx_lens += range(first_ctx, first_ctx + n)
        as_long = lambda xs: torch.tensor(xs, dtype=torch.long, device=self.device)
        return PagedQueries(token_indices=as_long(tokens), seq_rows=as_long(seq_rows),
                            start_lens=torch.full((len(tokens),), start, dtype=torch.long,
                                                  device=self.device),
                            ctx_lens=as_long(ctx_lens), block_tables=batch.block_tables,
                            split_keys=INVARIANT_SPLIT_KEYS if self.invariant else 0)

    # ---- forward ----------------------------------------------------------------------------
    def forward(self, layer: AttentionLayer, q: torch.Tensor, k: torch.Tensor,
                v: torch.Tensor, kv_cache: torch.Tensor, meta: CPUAttentionMetadata
                ) -> torch.Tensor:
        scale, sliding_window, soft_cap = layer.variant  # what the layer computes
        kv_scales = layer.kv_scales
        T, Hq, D = q.shape
        if (every := self.fused_decode_queries(meta, T)) is not None:
            # Every query goes to the kernel (a plain decode step): no gather / scatter, and
            # none of the PyTorch backend's per-group work.
            store_kv(kv_cache, k, v, meta.slot_mapping, kv_scales)
            return self._paged(q, kv_cache, every, scale, kv_scales, sliding_window,
                               soft_cap)[0].view(T, Hq * D)
        p = meta.paged
        if meta.prefills:  # (this backend makes no decode groups: cascades replace them)
            # stores k/v; (T, Hq * D)
            out = super().forward(layer, q, k, v, kv_cache, meta)
        else:
            store_kv(kv_cache, k, v, meta.slot_mapping, kv_scales)
            out = q.new_empty(T, Hq * D)
        out_q = out.view_as(q)
        if p is not None:
            out_q[p.token_indices] = self._paged(q[p.token_indices], kv_cache, p, scale,
                                                 kv_scales, sliding_window, soft_cap)[0]
        for c in meta.prefix_cascades:
            out_q[c.queries.token_indices] = self._cascade(q[c.queries.token_indices],
                                                           kv_cache, c, scale, kv_scales)
        return out

    def fused_decode_queries(self, meta: CPUAttentionMetadata,
                             num_tokens: int) -> PagedQueries | None:
        """The step's kernel queries when every one of its `num_tokens` queries goes to the
        kernel (a plain decode step: no cascade, no prefill chunk), else None; the fused
        small-batch decode call (models/cpu_decode.py) then runs the kernel itself."""
        p = meta.paged
        return p if p is not None and p.token_indices.numel() == num_tokens else None

    def _paged(self, q: torch.Tensor, kv_cache: torch.Tensor, p: PagedQueries, scale: float,
               kv_scales: torch.Tensor | None, window: int | None = None,
               soft_cap: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The kernel: out (N, Hq, D) and log-sum-exp (N, Hq) of q (N, Hq, D); with a window,
        each query attends only its last `window` positions (PagedQueries.first_keys)."""
        return self._op(q, kv_cache[0], kv_cache[1], p.block_tables, p.seq_rows,
                        p.first_keys(window), p.ctx_lens, scale, kv_scales, soft_cap or 0.0,
                        p.split_keys)

    def _cascade(self, q: torch.Tensor, kv_cache: torch.Tensor, c: PrefixCascade,
                 scale: float, kv_scales: torch.Tensor | None) -> torch.Tensor:
        """q (N, Hq, D) → (N, Hq, D): the shared prefix and each query's own part, merged."""
        out_p, lse_p = self._attend_prefix(q, kv_cache, c, scale, kv_scales)
        out_s, lse_s = self._paged(q, kv_cache, c.queries, scale, kv_scales)
        return merge_by_lse(out_p, lse_p, out_s, lse_s.unsqueeze(-1))

    def _attend_prefix(self, q: torch.Tensor, kv_cache: torch.Tensor, c: PrefixCascade,
                       scale: float, kv_scales: torch.Tensor | None
                       ) -> tuple[torch.Tensor, torch.Tensor]:
        """Every query against the whole shared prefix: out (N, Hq, D), lse (N, Hq, 1)."""
        N, Hq, D = q.shape
        Hkv = kv_cache.shape[-2]
        G = Hq // Hkv
        if c.shared_first_block is not None:
            first = c.shared_first_block
            prefix = kv_cache[:, first:first + c.shared_block_ids.numel()]
        else:
            prefix = self._gather(kv_cache, c.shared_block_ids)
        prefix = as_float(prefix, kv_scales, q.dtype)  # a quantized prefix: dequantized once
        prefix = prefix.flatten(1, 2).permute(0, 2, 1, 3)  # (2, Hkv, Lp, D), strided
        # Each KV head's queries (all tokens, G heads each) as one sequence against the prefix.
        q_flat = q.view(N, Hkv, G, D).transpose(0, 1).reshape(1, Hkv, N * G, D)
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q_flat, prefix[0].unsqueeze(0), prefix[1].unsqueeze(0), scale=scale)
        # out (1, Hkv, N * G, D), lse (1, Hkv, N * G)
        out = out.reshape(Hkv, N, G, D).transpose(0, 1).reshape(N, Hq, D)
        lse = lse.reshape(Hkv, N, G).transpose(0, 1).reshape(N, Hq, 1)
        return out, lse


def _first_if_consecutive(block_ids: torch.Tensor) -> int | None:
    """block_ids[0] when block_ids (k,) are consecutive increasing ids, else None."""
    first, last = int(block_ids[0]), int(block_ids[-1])
    if last - first + 1 != block_ids.numel():
        return None
    return first if bool((block_ids.diff() == 1).all()) else None
