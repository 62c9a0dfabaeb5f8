"""Pure-PyTorch paged attention: the CPU path and the oracle for any GPU kernel.

Decode sequences (one query each) that share a cached prefix form cascade groups (planned by
attention/cascade.py: the prefix attended once for the group); the others are sorted by
context length and split into a few groups. Each group gathers its K/V through the block
tables into a reused buffer and runs one batched SDPA call masked past each sequence's
length. Prefill sequences are done one at a time: with no cached prefix straight from this
step's k/v (causal), otherwise over the gathered cached context with an offset causal mask.

Sliding windows and soft-capped scores (base.py's FEATURES) are masks and a tanh on the
scores: a layer's window mask is built from its group's (or chunk's) positions once per step
and window size, shared by every layer with that window; soft-capped scores are computed
explicitly (SDPA has no hook for them). A model with either plans no cascades.

An int8 or fp8 cache (kv_cache.py) is read the same way and dequantized after the gather; a
prefill with no cached prefix attends its own k/v rounded to the cache's grid, as stored, so
that every path sees the values the cache holds and outputs do not depend on prefix-cache hits. This
backend is the oracle the kernels' quantized paths are checked against.

NOTE: the gather buffer is kept across layers and steps because a fresh ~100 MB tensor per
layer costs as much in page faults as the copy itself on CPU.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from tokenmill.attention.base import AttentionBackend, AttentionLayer
from tokenmill.attention.cascade import CascadePolicy, plan_cascades
from tokenmill.attention.input_batch import InputBatch
from tokenmill.attention.kv_cache import as_float, on_grid, store_kv
from tokenmill.attention.metadata import AttentionMetadata

# A decode group stops growing when the next (shorter) context would be padded by more than
# this fraction of the group's longest one.
_MAX_PAD_FRACTION = 0.25
_MAX_DECODE_GROUPS = 8
# Decodes sharing a cached prefix: attending it once pays from 4 blocks among 4 sequences.
CASCADE_POLICY = CascadePolicy(min_blocks=4, min_rows=4, min_queries=4)


@dataclass
class PrefillSeq:
    """One sequence with q_len > 1. Its queries are tokens [q_start, q_end) of the flat batch."""

    q_start: int
    q_end: int
    context_len: int  # tokens in cache after this step (cached prefix + this chunk)
    block_ids: torch.Tensor | None  # (num_blocks,) long; None when there is no cached prefix
    mask: torch.Tensor | None  # (q_len, context_len) bool, True = attend; None: plain causal
    # window size → mask (q_len, context_len): built by the first layer with that window
    window_masks: dict[int, torch.Tensor] = field(default_factory=dict)

    def causal_mask(self, window: int | None, device: torch.device) -> torch.Tensor:
        """(q_len, context_len) bool: query i (at position context_len - q_len + i) attends
        key j when j <= its position and, with a window, j > its position - window."""
        key = window or 0
        if key not in self.window_masks:
            q_len = self.q_end - self.q_start
            q_pos = torch.arange(self.context_len - q_len, self.context_len, device=device)
            k_pos = torch.arange(self.context_len, device=device)
            mask = k_pos[None, :] <= q_pos[:, None]
            if window:
                mask &= k_pos[None, :] > q_pos[:, None] - window
            self.window_masks[key] = mask
        return self.window_masks[key]


@dataclass
class DecodeGroup:
    """Decode sequences of similar length (or sharing a cached prefix), attended in one
    batched call: sorted by length, so that padding every row to its group's longest context
    wastes little gather work."""

    token_indices: torch.Tensor  # (Bg,) long: positions of their queries in the flat batch
    rows: torch.Tensor  # (Bg,) long: their rows in the batch's block tables
    block_ids: torch.Tensor  # (Bg * max_blocks,) long: block tables, row-major, null-padded
    max_blocks: int
    mask: torch.Tensor  # (Bg, 1, 1, max_blocks * block_size) bool, True = attend
    # Cascade: leading blocks every sequence of the group shares (a cached prefix). When set,
    # block_ids / max_blocks / mask describe only the blocks after them.
    shared_block_ids: torch.Tensor | None = None  # (k,) long
    seq_lens: torch.Tensor | None = None  # (Bg,) long: for window masks
    key_pos: torch.Tensor | None = None  # (max_blocks * block_size,) long: the keys' positions
    window_masks: dict[int, torch.Tensor] = field(default_factory=dict)

    def windowed_mask(self, window: int | None) -> torch.Tensor:
        """`mask` with each row's keys limited to its last `window` positions (None: mask)."""
        if window is None:
            return self.mask
        if window not in self.window_masks:
            inside = self.key_pos[None, :] >= self.seq_lens[:, None] - window
            self.window_masks[window] = self.mask & inside[:, None, None, :]
        return self.window_masks[window]


@dataclass
class TorchAttentionMetadata(AttentionMetadata):
    decode_groups: list[DecodeGroup] = field(default_factory=list)
    prefills: list[PrefillSeq] = field(default_factory=list)


def _attend(q: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
            mask: torch.Tensor | None, scale: float, soft_cap: float | None) -> torch.Tensor:
    """q (B, Hq, Lq, D), key / value (B, Hkv, Lk, D), mask bool broadcast to (B, Hq, Lq, Lk)
    (True = attend) or None (all) → (B, Hq, Lq, D). SDPA, or with soft-capped scores the
    same math written out (Gemma 2's eager attention: scale, cap * tanh(s / cap), mask)."""
    if soft_cap is None:
        return F.scaled_dot_product_attention(q, key, value, attn_mask=mask, scale=scale,
                                              enable_gqa=True)
    group = q.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(group, 1), value.repeat_interleave(group, 1)
    scores = torch.matmul(q, key.transpose(-1, -2)) * scale  # (B, Hq, Lq, Lk)
    scores = soft_cap * torch.tanh(scores / soft_cap)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1), value)


def _softmax_attend(scores: torch.Tensor, values: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax(scores) @ values and the log-sum-exp of scores (…, 1). scores (…, L)."""
    m = scores.amax(dim=-1, keepdim=True)
    p = torch.exp(scores - m)
    total = p.sum(dim=-1, keepdim=True)
    return torch.matmul(p, values) / total, m + torch.log(total)


def merge_by_lse(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor,
                 lse_b: torch.Tensor) -> torch.Tensor:
    """Attention over keys A ∪ B from the parts over A and over B: out (…, D), lse (…, 1)."""
    m = torch.maximum(lse_a, lse_b)
    w_a, w_b = torch.exp(lse_a - m), torch.exp(lse_b - m)
    return (out_a * w_a + out_b * w_b) / (w_a + w_b)


class TorchPagedAttention(AttentionBackend):
    FEATURES = frozenset({"sliding_window", "soft_cap"})

    def __init__(self, block_size: int, device: torch.device,
                 features: frozenset[str] = frozenset(), max_model_len: int | None = None
                 ) -> None:
        super().__init__(block_size, device, features, max_model_len)
        self._buffer = torch.empty(0, device=device)
        # a window could leave a cascade's shared prefix partly out of sight: none planned
        self.cascades = not features

    # ---- metadata ---------------------------------------------------------------------------
    def build_metadata(self, batch: InputBatch) -> TorchAttentionMetadata:
        meta = TorchAttentionMetadata(num_tokens=batch.num_tokens,
                                      slot_mapping=batch.slot_mapping)
        decode_rows = [i for i, n in enumerate(batch.query_lens) if n == 1]
        in_cascade: set[int] = set()
        cascades = (plan_cascades(batch, self.block_size, decode_rows, CASCADE_POLICY)
                    if self.cascades else [])
        for c in cascades:
            rows = sorted(c.rows, key=lambda i: -batch.seq_lens[i])
            meta.decode_groups.append(self._decode_group(batch, rows, c.num_blocks))
            in_cascade.update(rows)
        rest = [i for i in decode_rows if i not in in_cascade]
        for rows in self._group_by_length(rest, batch.seq_lens):
            meta.decode_groups.append(self._decode_group(batch, rows, 0))
        for i, n in enumerate(batch.query_lens):
            if n > 1:
                meta.prefills.append(self._prefill_seq(batch, i))
        return meta

    @staticmethod
    def _group_by_length(rows: list[int], seq_lens: list[int]) -> list[list[int]]:
        rows = sorted(rows, key=lambda i: -seq_lens[i])
        groups: list[list[int]] = []
        for i in rows:
            if (groups and len(groups) >= _MAX_DECODE_GROUPS) or (
                    groups and seq_lens[i] >= (1 - _MAX_PAD_FRACTION) * seq_lens[groups[-1][0]]):
                groups[-1].append(i)
            else:
                groups.append([i])
        return groups

    def _decode_group(self, batch: InputBatch, rows: list[int], k: int) -> DecodeGroup:
        """Decode `rows` (longest first) as one group; k > 0: their first k blocks are a
        shared prefix (a planned cascade)."""
        rows_t = torch.tensor(rows, device=self.device)
        max_blocks = -(-batch.seq_lens[rows[0]] // self.block_size)
        tables = batch.block_tables[rows_t, :max_blocks]  # (Bg, max_blocks)
        seq_lens = batch.seq_lens_t[rows_t]  # (Bg,)
        key_pos = torch.arange(k * self.block_size, max_blocks * self.block_size,
                               device=self.device)
        mask = (key_pos[None, :] < seq_lens[:, None])[:, None, None, :]
        return DecodeGroup(token_indices=batch.query_start_loc[rows_t], rows=rows_t,
                           block_ids=tables[:, k:].reshape(-1), max_blocks=max_blocks - k,
                           mask=mask, shared_block_ids=tables[0, :k] if k else None,
                           seq_lens=seq_lens, key_pos=key_pos)

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

    # ---- forward ----------------------------------------------------------------------------
    def forward(self, layer: AttentionLayer, q: torch.Tensor, k: torch.Tensor,
                v: torch.Tensor, kv_cache: torch.Tensor, meta: TorchAttentionMetadata
                ) -> torch.Tensor:
        scale, sliding_window, soft_cap = layer.variant  # what the layer computes
        kv_scales = layer.kv_scales
        store_kv(kv_cache, k, v, meta.slot_mapping, kv_scales)
        T, Hq, D = q.shape
        out = torch.empty_like(q)
        for group in meta.decode_groups:
            out[group.token_indices] = self._decode(q[group.token_indices], kv_cache, group,
                                                    scale, kv_scales, sliding_window, soft_cap)
        for p in meta.prefills:
            out[p.q_start:p.q_end] = self._prefill(q, k, v, kv_cache, p, scale, kv_scales,
                                                   sliding_window, soft_cap)
        return out.view(T, Hq * D)

    def _gather(self, kv_cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
        """K/V of `block_ids` (n,) from (2, num_blocks, bs, Hkv, D) → (2, n, bs, Hkv, D)."""
        shape = (2, block_ids.numel(), *kv_cache.shape[2:])
        numel = shape[0] * shape[1] * shape[2] * shape[3] * shape[4]
        if self._buffer.numel() < numel or self._buffer.dtype != kv_cache.dtype:
            self._buffer = torch.empty(numel, dtype=kv_cache.dtype, device=kv_cache.device)
        out = self._buffer[:numel].view(shape)
        return torch.index_select(kv_cache, 1, block_ids, out=out)

    def _decode(self, q: torch.Tensor, kv_cache: torch.Tensor, group: DecodeGroup,
                scale: float, kv_scales: torch.Tensor | None, window: int | None = None,
                soft_cap: float | None = None) -> torch.Tensor:
        if group.shared_block_ids is not None:  # (never with a window or a soft cap)
            return self._decode_cascade(q, kv_cache, group, scale, kv_scales)
        Bg = q.shape[0]
        # (2, Bg * nb, bs, Hkv, D)
        kv = as_float(self._gather(kv_cache, group.block_ids), kv_scales, q.dtype)
        kv = kv.view(2, Bg, -1, *kv.shape[-2:])  # (2, Bg, L, Hkv, D)
        key, value = kv[0].transpose(1, 2), kv[1].transpose(1, 2)  # (Bg, Hkv, L, D)
        o = _attend(q.unsqueeze(2), key, value, group.windowed_mask(window), scale,
                    soft_cap)  # (Bg, Hq, 1, D)
        return o.squeeze(2)

    def _decode_cascade(self, q: torch.Tensor, kv_cache: torch.Tensor, group: DecodeGroup,
                        scale: float, kv_scales: torch.Tensor | None) -> torch.Tensor:
        """Attention over a shared prefix (gathered once, all queries in one GEMM) and over each
        row's own suffix, merged by their log-sum-exps. q (Bg, Hq, D) → (Bg, Hq, D)."""
        out_p, lse_p = self._cascade_prefix(q, kv_cache, group, scale, kv_scales)
        out_s, lse_s = self._cascade_suffix(q, kv_cache, group, scale, kv_scales)
        return merge_by_lse(out_p, lse_p, out_s, lse_s)

    def _cascade_prefix(self, q: torch.Tensor, kv_cache: torch.Tensor, group: DecodeGroup,
                        scale: float, kv_scales: torch.Tensor | None
                        ) -> tuple[torch.Tensor, torch.Tensor]:
        """The shared prefix part: out (Bg, Hq, D) and log-sum-exp (Bg, Hq, 1)."""
        Bg, Hq, D = q.shape
        Hkv = kv_cache.shape[-2]
        G = Hq // Hkv
        prefix = as_float(kv_cache[:, group.shared_block_ids], kv_scales, q.dtype)
        prefix = prefix.flatten(1, 2)  # (2, Lp, Hkv, D)
        q_flat = q.view(Bg, Hkv, G, D).permute(1, 0, 2, 3).reshape(Hkv, Bg * G, D)
        s_p = torch.matmul(q_flat, prefix[0].permute(1, 2, 0)) * scale  # (Hkv, Bg*G, Lp)
        out_p, lse_p = _softmax_attend(s_p, prefix[1].transpose(0, 1))  # (Hkv, Bg*G, D)
        out_p = out_p.view(Hkv, Bg, G, D).permute(1, 0, 2, 3).reshape(Bg, Hq, D)
        lse_p = lse_p.view(Hkv, Bg, G).permute(1, 0, 2).reshape(Bg, Hq, 1)
        return out_p, lse_p

    def _cascade_suffix(self, q: torch.Tensor, kv_cache: torch.Tensor, group: DecodeGroup,
                        scale: float, kv_scales: torch.Tensor | None
                        ) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's blocks after the shared prefix: out (Bg, Hq, D), log-sum-exp (Bg, Hq, 1)."""
        Bg, Hq, D = q.shape
        Hkv = kv_cache.shape[-2]
        qg = q.view(Bg, Hkv, Hq // Hkv, D)
        kv = as_float(self._gather(kv_cache, group.block_ids), kv_scales, q.dtype)
        kv = kv.view(2, Bg, -1, Hkv, D)
        s_s = torch.matmul(qg, kv[0].permute(0, 2, 3, 1)) * scale  # (Bg, Hkv, G, Ls)
        s_s = s_s.masked_fill(~group.mask, float("-inf"))
        out_s, lse_s = _softmax_attend(s_s, kv[1].transpose(1, 2))  # (Bg, Hkv, G, D)
        return out_s.reshape(Bg, Hq, D), lse_s.reshape(Bg, Hq, 1)

    def _prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 kv_cache: torch.Tensor, p: PrefillSeq, scale: float,
                 kv_scales: torch.Tensor | None = None, window: int | None = None,
                 soft_cap: float | None = None) -> torch.Tensor:
        plain = window is None and soft_cap is None
        qs = q[p.q_start:p.q_end].transpose(0, 1).unsqueeze(0)  # (1, Hq, q_len, D)
        if p.block_ids is None:
            k_own, v_own = k[p.q_start:p.q_end], v[p.q_start:p.q_end]  # (q_len, Hkv, D)
            if kv_cache.dtype != k_own.dtype:  # the values the cache holds (quantized or
                k_own = on_grid(k_own, kv_cache.dtype, None if kv_scales is None  # bf16),
                                else kv_scales[0])  # as every other path reads them
                v_own = on_grid(v_own, kv_cache.dtype, None if kv_scales is None
                                else kv_scales[1])
            key = k_own.transpose(0, 1).unsqueeze(0)  # (1, Hkv, q_len, D)
            value = v_own.transpose(0, 1).unsqueeze(0)
            if plain:
                o = F.scaled_dot_product_attention(qs, key, value, is_causal=True,
                                                   scale=scale, enable_gqa=True)
            else:
                o = _attend(qs, key, value, p.causal_mask(window, q.device), scale, soft_cap)
        else:
            kv = as_float(self._gather(kv_cache, p.block_ids), kv_scales, q.dtype)
            kv = kv.flatten(1, 2)[:, :p.context_len]
            key = kv[0].transpose(0, 1).unsqueeze(0)  # (1, Hkv, ctx, D)
            value = kv[1].transpose(0, 1).unsqueeze(0)
            mask = p.mask if window is None else p.causal_mask(window, q.device)
            o = _attend(qs, key, value, mask, scale, soft_cap)
        return o.squeeze(0).transpose(0, 1)  # (q_len, Hq, D)
