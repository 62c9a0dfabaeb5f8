"""A step's sampling, which reads no runner state but its Sampler: the grammars' bitmasks over
the logits, the sampling or the verification of draft tokens, the logprobs of prompt tokens and
each request's share of the sampled tokens' logprobs (worker/model_runner.py calls them; the
Sampler does the drawing).

Invariant: on a GPU a step waits for the device once, when it reads its sampled ids (none
when the step is left in flight); logprobs are copied to the host before that read and ride
with it (prompt logprobs: one wait for all of a step's requests).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from tokenmill.attention.input_batch import InputBatch, tensor_on
from tokenmill.core.interface import (
    GrammarOutput,
    ModelRunnerOutput,
    PositionLogprobs,
    ScheduledRequest,
    SchedulerOutput,
)
from tokenmill.layers.rejection_sampler import verify
from tokenmill.layers.sampler import LogprobTensors, Sampler, gather_logprobs, lists_of
from tokenmill.layers.token_bitmask import apply_token_bitmask_
from tokenmill.utils.profiling import scope


@dataclass
class SampledLogprobs:
    """A step's sampled tokens' logprobs on their way to the host (`LogprobTensors.to_host`):
    which request reads which row, cut to its own top-k. Written into the step's output once
    the copies are done (after its ids are read, or its in-flight event has passed)."""

    host: LogprobTensors
    wanted: list[tuple[str, int, int]]  # (req_id, row, 1 + its k)

    def write(self, out: ModelRunnerOutput) -> None:
        lps = self.host.lists()
        for req_id, row, width in self.wanted:
            out.logprobs[req_id] = PositionLogprobs([lps.token_ids[row][:width]],
                                                    [lps.logprobs[row][:width]],
                                                    [lps.ranks[row][:width]])


def sample_step(sampler: Sampler, sched: SchedulerOutput, grammar: GrammarOutput | None,
                reqs: list[ScheduledRequest], batch: InputBatch, logits: torch.Tensor,
                out: ModelRunnerOutput, defer: bool = False
                ) -> tuple[torch.Tensor, SampledLogprobs | None] | None:
    """Tokens for the rows that sample (logits (S, V)): grammar masks, then sampling or the
    verification of drafts, and the logprobs asked for. defer: the sampled ids (S,) are
    returned on the device, not yet in `out`, with their logprobs on their way to the host
    (drafts are never deferred); else both are in `out`, after one wait for the device."""
    if grammar is not None:
        with scope("grammar_bitmask"):
            apply_grammar(sched, grammar, batch.sample_rows, logits)
    with scope("sample"):
        rows = [reqs[i] for i in batch.sample_rows]
        if any(r.spec_token_ids for r in rows):
            verify_drafts(sampler, logits, rows, batch.sample_rows, out)
            return None
        tokens, logprobs = sampler(logits, rows)
        sampled = None
        if logprobs is not None:  # their copies queued before the ids are read
            sampled = SampledLogprobs(logprobs.to_host(), [
                (out.req_ids[i], j, 1 + k) for j, i in enumerate(batch.sample_rows)
                if (k := rows[j].sampling_params.logprobs) is not None])
        if defer:
            return tokens, sampled
        for i, t in zip(batch.sample_rows, tokens.tolist(), strict=True):  # one host sync
            out.sampled_token_ids[i] = [t]
        if sampled is not None:
            sampled.write(out)
    return None


def verify_drafts(sampler: Sampler, logits: torch.Tensor, rows: list[ScheduledRequest],
                  sample_rows: list[int], out: ModelRunnerOutput) -> None:
    """A step with draft tokens: each row's accepted drafts and next token (logits (P, V),
    num_sample_positions rows per request; layers/rejection_sampler.py)."""
    emitted, logprobs = verify(sampler, logits, rows)
    for i, tokens, lps in zip(sample_rows, emitted, logprobs, strict=True):
        out.sampled_token_ids[i] = tokens
        if lps is not None:
            out.logprobs[out.req_ids[i]] = lps


def prompt_logprobs(model: nn.Module, reqs: list[ScheduledRequest], batch: InputBatch,
                    hidden: torch.Tensor, out: ModelRunnerOutput) -> None:
    """Logprobs of prompt tokens covered by this step, for requests that asked for them
    (brought over after one wait for all of them)."""
    starts: dict[str, int] = {}
    tensors: list[LogprobTensors | None] = []
    for i, r in enumerate(reqs):
        positions = r.prompt_logprob_positions
        if not positions:
            continue
        first = batch.query_start_locs[i] + positions.start - r.start_pos
        idx = torch.arange(first, first + len(positions), device=hidden.device)
        logprobs = model.compute_logits(hidden, idx).float().log_softmax(dim=-1)
        targets = tensor_on(r.prompt_token_ids[positions.start + 1:positions.stop + 1],
                            hidden.device)
        starts[r.req_id] = positions.start + 1
        tensors.append(gather_logprobs(logprobs, targets, r.sampling_params.prompt_logprobs))
    for (req_id, start), lps in zip(starts.items(), lists_of(tensors), strict=True):
        out.prompt_logprobs[req_id] = (start, lps)


def apply_grammar(sched: SchedulerOutput, grammar: GrammarOutput, sample_rows: list[int],
                  logits: torch.Tensor) -> None:
    """Mask each constrained request's sampled positions with its grammar's bitmask (filled on
    the worker thread during the forward pass), before the sampler sees the logits (P, V)."""
    masks = grammar.masks()  # req_id → (num_sample_positions, W)
    rows: list[int] = []
    parts: list[torch.Tensor] = []
    first = 0
    for i in sample_rows:
        r = sched.scheduled[i]
        if (mask := masks.get(r.req_id)) is not None:
            rows += range(first, first + r.num_sample_positions)
            parts.append(mask[:r.num_sample_positions])
        first += r.num_sample_positions
    if rows:
        apply_token_bitmask_(logits, torch.cat(parts), tensor_on(rows, logits.device))
