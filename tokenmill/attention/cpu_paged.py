"""CPUPagedAttention: decode attended straight from the paged KV cache by a C++ kernel.

Which path each query takes in a step:
- decode queries and short chunks (at most `_KERNEL_MAX_QUERY` tokens: speculative verification,
  a prompt's tail) go to the kernel (csrc/paged_attention_cpu.cpp), one call for all of them:
  it reads each sequence's cached K/V once, in place, instead of gathering a padded copy;
- decode groups that share a long cached prefix use cascade attention: the prefix once for
  the whole group as a GEMM (PyTorch), each row's own suffix by the kernel, merged through
  their log-sum-exps (reading the prefix once per sequence would cost far more);
- longer prefill chunks keep the PyTorch path: they are GEMM-bound, and gathering their cached
  context once costs little next to q_len x context attention math.

Same contract and results as TorchPagedAttention (its oracle), float32 only.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tokenmill.attention.cpu_kernels import paged_attention_op
from tokenmill.attention.kv_cache import store_kv
from tokenmill.attention.metadata import AttentionMetadata, DecodeGroup, PagedQueries
from tokenmill.attention.torch_ref import TorchPagedAttention
from tokenmill.worker.input_batch import InputBatch

_KERNEL_MAX_QUERY = 8


@dataclass
class KernelCascadeGroup(DecodeGroup):
    """A cascade decode group whose suffix part the kernel reads in place."""

    block_tables: torch.Tensor | None = None  # (B, max_blocks) long: the whole batch's
    start_lens: torch.Tensor | None = None  # (Bg,) long: the shared prefix's length
    ctx_lens: torch.Tensor | None = None  # (Bg,) long: each row's context length


class CPUPagedAttention(TorchPagedAttention):
    def __init__(self, block_size: int, device: torch.device) -> None:
        super().__init__(block_size, device)
        op = paged_attention_op()
        if op is None:
            raise RuntimeError("the CPU paged-attention kernel is not available "
                               "(see the warning above); use attention_backend='torch'")
        self._op = op

    def build_metadata(self, batch: InputBatch) -> AttentionMetadata:
        meta = AttentionMetadata(num_tokens=batch.num_tokens, slot_mapping=batch.slot_mapping)
        cascade_rows: set[int] = set()
        decode_rows = [i for i, n in enumerate(batch.query_lens) if n == 1]
        for group_rows in self._group_by_length(decode_rows, batch.seq_lens):
            rows_t, tables, k = self._group_tables(batch, group_rows)
            if k:
                group = self._make_decode_group(batch, rows_t, tables, k)
                meta.decode_groups.append(KernelCascadeGroup(
                    **vars(group), block_tables=batch.block_tables,
                    start_lens=torch.full_like(rows_t, k * self.block_size),
                    ctx_lens=batch.seq_lens_t[rows_t]))
                cascade_rows.update(group_rows)
        # Everything else, in flat-batch order: when every query of the step goes to the
        # kernel they are exactly tokens 0..T-1, and forward passes q through without a gather.
        tokens: list[int] = []
        rows: list[int] = []
        ctx_lens: list[int] = []
        for i, n in enumerate(batch.query_lens):
            if i in cascade_rows:
                continue
            if n > _KERNEL_MAX_QUERY:
                meta.prefills.append(self._prefill_seq(batch, i))
                continue
            first_ctx = batch.seq_lens[i] - n + 1  # query j sees the cache up to itself
            tokens += range(batch.query_start_locs[i], batch.query_start_locs[i + 1])
            rows += [i] * n
            ctx_lens += range(first_ctx, first_ctx + n)
        if tokens:
            as_long = lambda xs: torch.tensor(xs, dtype=torch.long, device=self.device)
            meta.paged = PagedQueries(token_indices=as_long(tokens), seq_rows=as_long(rows),
                                      start_lens=torch.zeros(len(tokens), dtype=torch.long,
                                                             device=self.device),
                                      ctx_lens=as_long(ctx_lens),
                                      block_tables=batch.block_tables)
        return meta

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        p = meta.paged
        if p is not None and p.token_indices.numel() == q.shape[0]:
            # Every query goes to the kernel (a plain decode step): no gather / scatter, and
            # none of the PyTorch backend's per-group work.
            store_kv(kv_cache, k, v, meta.slot_mapping)
            T, Hq, D = q.shape
            return self._op(q, kv_cache[0], kv_cache[1], p.block_tables, p.seq_rows,
                            p.start_lens, p.ctx_lens, scale)[0].view(T, Hq * D)
        out = super().forward(q, k, v, kv_cache, meta, scale)  # stores k/v; (T, Hq * D)
        if p is not None:
            out.view_as(q)[p.token_indices] = self._op(
                q[p.token_indices], kv_cache[0], kv_cache[1], p.block_tables, p.seq_rows,
                p.start_lens, p.ctx_lens, scale)[0]
        return out

    def _cascade_suffix(self, q: torch.Tensor, kv_cache: torch.Tensor, group: DecodeGroup,
                        scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        if not isinstance(group, KernelCascadeGroup):
            return super()._cascade_suffix(q, kv_cache, group, scale)
        out, lse = self._op(q, kv_cache[0], kv_cache[1], group.block_tables, group.rows,
                            group.start_lens, group.ctx_lens, scale)
        return out, lse.unsqueeze(-1)  # (Bg, Hq, D), (Bg, Hq, 1)
