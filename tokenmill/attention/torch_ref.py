"""Pure-PyTorch paged attention: the CPU path and the oracle for any GPU kernel.

Decode sequences (one query each) are attended in one batched SDPA call over K/V gathered
through their block tables and masked past each sequence's length. Prefill sequences are done
one at a time: with no cached prefix straight from this step's k/v (causal), otherwise over the
gathered cached context with an offset causal mask.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tokenmill.attention.base import AttentionBackend
from tokenmill.attention.kv_cache import store_kv
from tokenmill.attention.metadata import AttentionMetadata, DecodeBatch, PrefillSeq
from tokenmill.worker.input_batch import InputBatch


class TorchPagedAttention(AttentionBackend):
    def build_metadata(self, batch: InputBatch) -> AttentionMetadata:
        q_lens = batch.query_lens  # python ints, one per sequence
        is_decode = [n == 1 for n in q_lens]
        meta = AttentionMetadata(num_tokens=batch.num_tokens, slot_mapping=batch.slot_mapping)
        dec_rows = [i for i, d in enumerate(is_decode) if d]
        if dec_rows:
            meta.decode = self._decode_batch(batch, dec_rows)
        for i, decode in enumerate(is_decode):
            if not decode:
                meta.prefills.append(self._prefill_seq(batch, i))
        return meta

    def _decode_batch(self, batch: InputBatch, rows: list[int]) -> DecodeBatch:
        all_rows = len(rows) == len(batch.query_lens)
        rows_t = torch.tensor(rows, device=self.device)
        seq_lens = batch.seq_lens_t if all_rows else batch.seq_lens_t[rows_t]
        max_blocks = -(-int(seq_lens.max()) // self.block_size)
        tables = batch.block_tables if all_rows else batch.block_tables[rows_t]
        tables = tables[:, :max_blocks]
        key_pos = torch.arange(max_blocks * self.block_size, device=self.device)
        mask = (key_pos[None, :] < seq_lens[:, None])[:, None, None, :]
        token_idx = batch.query_start_loc[:-1][rows_t] if not all_rows else rows_t
        return DecodeBatch(token_indices=token_idx, block_tables=tables, mask=mask,
                           all_tokens=all_rows)

    def _prefill_seq(self, batch: InputBatch, i: int) -> PrefillSeq:
        q_start, q_end = batch.query_start_locs[i], batch.query_start_locs[i + 1]
        ctx = batch.seq_lens[i]
        q_len = q_end - q_start
        if ctx == q_len:  # no cached prefix: attend over this step's own k/v
            return PrefillSeq(q_start, q_end, ctx, block_ids=None, mask=None)
        num_blocks = -(-ctx // self.block_size)
        q_pos = torch.arange(ctx - q_len, ctx, device=self.device)
        mask = torch.arange(ctx, device=self.device)[None, :] <= q_pos[:, None]
        return PrefillSeq(q_start, q_end, ctx, block_ids=batch.block_tables[i, :num_blocks],
                          mask=mask)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        store_kv(kv_cache, k, v, meta.slot_mapping)
        T, Hq, D = q.shape
        out = torch.empty_like(q)
        if meta.decode is not None:
            dec = meta.decode
            q_dec = q if dec.all_tokens else q[dec.token_indices]
            out_dec = self._decode(q_dec, kv_cache, dec, scale)  # (Bd, Hq, D)
            if dec.all_tokens:
                return out_dec.reshape(T, Hq * D)
            out[dec.token_indices] = out_dec
        for p in meta.prefills:
            out[p.q_start:p.q_end] = self._prefill(q, k, v, kv_cache, p, scale)
        return out.view(T, Hq * D)

    @staticmethod
    def _gather(kv_cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
        """(2, *block_ids.shape, block_size, Hkv, D) → K/V of those blocks, tokens flattened."""
        kv = kv_cache[:, block_ids]  # (2, ..., nb, bs, Hkv, D)
        return kv.flatten(-4, -3)  # (2, ..., nb * bs, Hkv, D)

    def _decode(self, q: torch.Tensor, kv_cache: torch.Tensor, dec: DecodeBatch,
                scale: float) -> torch.Tensor:
        kv = self._gather(kv_cache, dec.block_tables)  # (2, Bd, L, Hkv, D)
        key, value = kv[0].transpose(1, 2), kv[1].transpose(1, 2)  # (Bd, Hkv, L, D)
        o = F.scaled_dot_product_attention(q.unsqueeze(2), key, value, attn_mask=dec.mask,
                                           scale=scale, enable_gqa=True)  # (Bd, Hq, 1, D)
        return o.squeeze(2)

    def _prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 kv_cache: torch.Tensor, p: PrefillSeq, scale: float) -> torch.Tensor:
        qs = q[p.q_start:p.q_end].transpose(0, 1).unsqueeze(0)  # (1, Hq, q_len, D)
        if p.block_ids is None:
            key = k[p.q_start:p.q_end].transpose(0, 1).unsqueeze(0)  # (1, Hkv, q_len, D)
            value = v[p.q_start:p.q_end].transpose(0, 1).unsqueeze(0)
            o = F.scaled_dot_product_attention(qs, key, value, is_causal=True, scale=scale,
                                               enable_gqa=True)
        else:
            kv = self._gather(kv_cache, p.block_ids)[:, :p.context_len]  # (2, ctx, Hkv, D)
            key = kv[0].transpose(0, 1).unsqueeze(0)  # (1, Hkv, ctx, D)
            value = kv[1].transpose(0, 1).unsqueeze(0)
            o = F.scaled_dot_product_attention(qs, key, value, attn_mask=p.mask, scale=scale,
                                               enable_gqa=True)
        return o.squeeze(0).transpose(0, 1)  # (q_len, Hq, D)
