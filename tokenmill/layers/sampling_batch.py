"""SamplingBatch: the per-row sampling parameters of one step as tensors, and the logit
transformations that use them. Built once per step from the rows that sample; every transform
is a whole-batch tensor op and is skipped when no row needs it.

Penalties (vLLM and HF semantics): repetition divides positive logits and multiplies negative
ones by the penalty for every token seen in the prompt or output; frequency subtracts
penalty * count and presence subtracts penalty once, for tokens seen in the output.

The parameters cross to a GPU from pinned memory without blocking the host (input_batch.py's
tensor_on), so building them never waits for the step's forward pass.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import torch

from tokenmill.attention.input_batch import tensor_on, to_device
from tokenmill.core.interface import ScheduledRequest


@dataclass
class SamplingBatch:
    temperature: torch.Tensor  # (S,) float, 1.0 for greedy rows
    is_greedy: torch.Tensor  # (S,) bool
    all_greedy: bool
    any_greedy: bool
    seeded_rows: list[int]
    rows: list[ScheduledRequest]
    vocab_size: int
    max_logprobs: int | None

    @staticmethod
    def build(rows: list[ScheduledRequest], vocab_size: int,
              device: torch.device) -> SamplingBatch:
        params = [r.sampling_params for r in rows]
        greedy = [p.is_greedy for p in params]
        wanted = [p.logprobs for p in params if p.logprobs is not None]
        return SamplingBatch(
            temperature=tensor_on([1.0 if g else p.temperature
                                   for g, p in zip(greedy, params, strict=True)], device),
            is_greedy=tensor_on(greedy, device),
            all_greedy=all(greedy), any_greedy=any(greedy),
            seeded_rows=[i for i, p in enumerate(params) if p.seed is not None and not greedy[i]],
            rows=rows, vocab_size=vocab_size, max_logprobs=max(wanted) if wanted else None)

    def _param(self, name: str, logits: torch.Tensor) -> torch.Tensor:
        return tensor_on([getattr(r.sampling_params, name) for r in self.rows],
                         logits.device, logits.dtype)

    def apply_bias_and_bans(self, logits: torch.Tensor) -> torch.Tensor:
        rows, cols, vals = [], [], []
        ban_rows, ban_cols = [], []
        for i, r in enumerate(self.rows):
            for token, bias in r.sampling_params.logit_bias.items():
                if token < self.vocab_size:
                    rows.append(i)
                    cols.append(token)
                    vals.append(bias)
            ban_rows += [i] * len(r.banned_token_ids)
            ban_cols += r.banned_token_ids
        if rows:
            idx = (tensor_on(rows, logits.device), tensor_on(cols, logits.device))
            logits = logits.index_put(idx, tensor_on(vals, logits.device, logits.dtype),
                                      accumulate=True)
        if ban_rows:
            idx = (tensor_on(ban_rows, logits.device), tensor_on(ban_cols, logits.device))
            logits = logits.index_put(idx, tensor_on(float("-inf"), logits.device,
                                                     logits.dtype))
        return self._apply_allowed(logits)

    def _apply_allowed(self, logits: torch.Tensor) -> torch.Tensor:
        """Rows with allowed_token_ids: every other token at -inf. logits (S, V)."""
        limited = [(i, r.sampling_params.allowed_token_ids) for i, r in enumerate(self.rows)
                   if r.sampling_params.allowed_token_ids is not None]
        if not limited:
            return logits
        keep = torch.zeros(len(limited), logits.shape[-1], dtype=torch.bool)  # (L, V), host
        keep[[j for j, (_, ids) in enumerate(limited) for _ in ids],
             [t for _, ids in limited for t in ids]] = True
        rows = tensor_on([i for i, _ in limited], logits.device)
        kept = logits[rows].masked_fill(~to_device([keep], logits.device)[0], float("-inf"))
        return logits.index_put((rows,), kept)

    def apply_penalties(self, logits: torch.Tensor) -> torch.Tensor:
        if not any(r.sampling_params.has_penalties for r in self.rows):
            return logits
        S, V = logits.shape
        output_counts = _token_counts([r.output_token_ids for r in self.rows], S, V, logits)
        if any(r.sampling_params.repetition_penalty != 1.0 for r in self.rows):  # no device sync
            rep = self._param("repetition_penalty", logits)
            seen = _token_counts([r.prompt_token_ids for r in self.rows], S, V, logits) > 0
            seen |= output_counts > 0
            penalized = torch.where(logits > 0, logits / rep[:, None], logits * rep[:, None])
            logits = torch.where(seen, penalized, logits)
        logits = logits - self._param("frequency_penalty", logits)[:, None] * output_counts
        presence = self._param("presence_penalty", logits)[:, None]
        return logits - presence * (output_counts > 0).to(logits.dtype)

    def apply_min_p(self, logits: torch.Tensor) -> torch.Tensor:
        """Drop tokens whose probability is below min_p times the most likely token's."""
        if not any(r.sampling_params.min_p > 0 for r in self.rows):
            return logits
        probs = logits.softmax(dim=-1)
        threshold = probs.amax(dim=-1, keepdim=True) * self._param("min_p", logits)[:, None]
        return logits.masked_fill(probs < threshold, float("-inf"))

    def apply_top_k_top_p(self, logits: torch.Tensor) -> torch.Tensor:
        """Set logits outside each row's top-k and top-p nucleus to -inf. logits (S, V)."""
        top_k = [r.sampling_params.top_k for r in self.rows]
        top_p = [r.sampling_params.top_p for r in self.rows]
        if not any(top_k) and all(p >= 1.0 for p in top_p):
            return logits
        vocab = logits.shape[-1]
        if all(p >= 1.0 for p in top_p):
            return self._top_k_only(logits, top_k)
        sorted_logits, order = logits.sort(dim=-1, descending=True)  # (S, V)
        ranks = torch.arange(vocab, device=logits.device)
        k = tensor_on([k if k > 0 else vocab for k in top_k], logits.device)
        sorted_logits = sorted_logits.masked_fill(ranks[None, :] >= k[:, None], float("-inf"))
        probs = sorted_logits.softmax(dim=-1)
        # Keep a token when the mass strictly before it is below top_p (the first always stays).
        before = probs.cumsum(dim=-1) - probs
        p = tensor_on(top_p, logits.device, probs.dtype)
        sorted_logits = sorted_logits.masked_fill(before >= p[:, None], float("-inf"))
        return torch.empty_like(logits).scatter_(-1, order, sorted_logits)

    @staticmethod
    def _top_k_only(logits: torch.Tensor, top_k: list[int]) -> torch.Tensor:
        """Top-k without top-p: one partial top-k to each row's k-th largest logit instead of
        a full sort of the vocabulary (~10x less work at V = 49152). A logit tied with the
        k-th stays (so may a row keep more than k tokens, on exact ties only)."""
        vocab = logits.shape[-1]
        k_max = max(k for k in top_k if k > 0)
        if k_max >= vocab:
            return logits
        top = logits.topk(k_max, dim=-1).values  # (S, k_max), descending
        k = tensor_on([min(k, k_max) if k > 0 else k_max for k in top_k], logits.device)
        kth = top.gather(-1, (k - 1)[:, None])  # (S, 1)
        no_top_k = tensor_on([k <= 0 or k >= vocab for k in top_k], logits.device)
        kth = kth.masked_fill(no_top_k[:, None], float("-inf"))
        return logits.masked_fill(logits < kth, float("-inf"))


def _token_counts(token_lists: list[list[int]], S: int, V: int,
                  like: torch.Tensor) -> torch.Tensor:
    """(S, V) counts of each token id in each row's list, via one bincount over offset ids."""
    lengths = torch.tensor([len(t) for t in token_lists])
    # (numpy reads the lists at ~10 ns a token: every prompt and output token of the rows
    # with penalties, at every step)
    flat = torch.from_numpy(np.fromiter(itertools.chain.from_iterable(token_lists), np.int64,
                                        int(lengths.sum())))
    if flat.numel() == 0:
        return torch.zeros(S, V, dtype=like.dtype, device=like.device)
    offsets = torch.repeat_interleave(torch.arange(S) * V, lengths)
    # the ids cross to the device, not the (S, V) counts (integer counts: the same anywhere)
    ids = to_device([flat + offsets], like.device)[0]
    counts = torch.bincount(ids, minlength=S * V)
    return counts.view(S, V).to(device=like.device, dtype=like.dtype)
