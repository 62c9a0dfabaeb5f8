"""Verifying draft tokens (speculative decoding): which drafts a step accepts, and the token
after them, distributed exactly as sampling without speculation.

A row with k drafts d_0..d_{k-1} has logits at k + 1 positions: position j predicts the token
after the request's tokens plus d_0..d_{j-1}. Each position is sampled as the Sampler would
sample it there: logit bias, min_tokens bans and penalties see the output plus the drafts
before it, then temperature, min_p, top-k and top-p give the target distribution p_j.
- greedy rows accept d_j while it is the argmax of position j; the first position that
  disagrees (or the last, when all agree) contributes its argmax;
- random rows accept d_j with probability min(1, p_j(d_j) / q_j(d_j)) and otherwise draw from
  the residual max(0, p_j - q_j), normalised, q_j being the distribution d_j was sampled from
  (`spec_draft_probs`: a draft model's, for a sampled request); a draft chosen outright
  (n-gram, suffix, a greedy draft) has a one-hot q, so the rule is: accept with probability
  p_j(d_j), else draw from p_j with d_j removed. After k acceptances the bonus token is drawn
  from p_k. Each emitted token is then distributed as p at its position (Leviathan et al.
  2023, SpecInfer).
Logprobs of the emitted tokens come from the raw distributions, as without speculation.
"""

from __future__ import annotations

import dataclasses

import torch

from tokenmill.attention.input_batch import tensor_on
from tokenmill.core.interface import PositionLogprobs, ScheduledRequest
from tokenmill.layers import cpu_ops
from tokenmill.layers.sampler import LogprobTensors, Sampler, gather_logprobs, lists_of
from tokenmill.layers.sampling_batch import SamplingBatch


def position_rows(row: ScheduledRequest) -> list[ScheduledRequest]:
    """One row per sampled position of `row`, each seeing the drafts before it as output."""
    out = [dataclasses.replace(row, spec_token_ids=[], spec_banned_token_ids=[])]
    for j, bans in enumerate(row.spec_banned_token_ids, start=1):
        out.append(dataclasses.replace(
            out[0], output_token_ids=row.output_token_ids + row.spec_token_ids[:j],
            banned_token_ids=bans))
    return out


def verify(sampler: Sampler, logits: torch.Tensor, rows: list[ScheduledRequest]
           ) -> tuple[list[list[int]], list[PositionLogprobs | None]]:
    """logits (P, V), rows' sampled positions one after another (row i: num_sample_positions
    of them) → for each row the emitted tokens (accepted drafts, then one sampled token) and,
    where it asked, their logprobs."""
    prow = [p for r in rows for p in position_rows(r)]
    b = SamplingBatch.build(prow, logits.shape[-1], logits.device)
    raw, target = sampler.target_logits(logits, b)
    # (P,): -1 at each row's last position
    drafts = tensor_on([d for r in rows for d in [*r.spec_token_ids, -1]], logits.device)
    has_draft = drafts >= 0
    safe = drafts.clamp(min=0)[:, None]
    greedy_ids = cpu_ops.argmax(target)  # (P,)
    accept = greedy_ids == drafts
    chosen = greedy_ids
    if not b.all_greedy:
        probs = sampler.probs(target, b)  # (P, V)
        q = _draft_distributions(rows, has_draft, safe, probs)  # (P, V)
        uniform = sampler.noise(drafts, b, prow, kind="uniform")  # (P,)
        # accept with probability min(1, p(d) / q(d)); q(d) > 0 for a drafted d
        accept_random = uniform * q.gather(-1, safe).squeeze(-1) < probs.gather(-1, safe
                                                                                ).squeeze(-1)
        # rejected: draw from max(0, p - q) normalised; at the last position q = 0: from p.
        # (p <= q everywhere means p = q, where a draft is never rejected: p then stands in.)
        residual = (probs - q).clamp_(min=0)
        residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, probs)
        drawn = cpu_ops.argmax(residual / sampler.noise(residual, b, prow))
        accept = torch.where(b.is_greedy, accept, accept_random)
        chosen = torch.where(b.is_greedy, greedy_ids, drawn)
    # one transfer to the host (one sync on a GPU): -1 where the draft is accepted, else the
    # token chosen in its place (never negative)
    verdict = torch.where(accept & has_draft, -1, chosen).tolist()
    emitted: list[list[int]] = []
    first = 0
    for r in rows:
        tokens = []
        for j in range(r.num_sample_positions):
            if verdict[first + j] < 0:
                tokens.append(r.spec_token_ids[j])
            else:
                tokens.append(verdict[first + j])
                break
        emitted.append(tokens)
        first += r.num_sample_positions
    return emitted, _logprobs(raw, rows, emitted, b.max_logprobs)


def _draft_distributions(rows: list[ScheduledRequest], has_draft: torch.Tensor,
                         safe: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """(P, V) q at each sampled position: a draft's own distribution where it came with one,
    else one-hot at the draft; zero at each row's last position (no draft there)."""
    q = torch.zeros_like(like).scatter_(-1, safe, has_draft[:, None].to(like.dtype))
    first = 0
    for r in rows:
        if r.spec_draft_probs is not None:
            q[first:first + len(r.spec_token_ids)] = r.spec_draft_probs.to(like.dtype)
        first += r.num_sample_positions
    return q


def _logprobs(raw: torch.Tensor | None, rows: list[ScheduledRequest],
              emitted: list[list[int]], k: int | None) -> list[PositionLogprobs | None]:
    """Each row's logprobs of its emitted tokens (raw (P, V); None where none asked), brought
    over after one wait."""
    if raw is None:
        return [None] * len(rows)
    out: list[LogprobTensors | None] = []
    first = 0
    for r, tokens in zip(rows, emitted, strict=True):
        want = r.sampling_params.logprobs
        if want is None:
            out.append(None)
        else:
            idx = torch.arange(first, first + len(tokens), device=raw.device)
            out.append(gather_logprobs(raw[idx], tensor_on(tokens, raw.device), want))
        first += r.num_sample_positions
    return lists_of(out)
