"""InFlightStep: a step whose work is queued on the device and whose sampled tokens are still
on their way to the host (async scheduling on one runner: vLLM's async output).

With async scheduling the engine hands the runner step N+1 while the device still runs step N.
The runner prepares N+1's inputs then, not after N's tokens reach the host, so the device goes
from N to N+1 without waiting for the host (`ModelRunner.launch`):

    launch(N):   inputs, forward pass and sampling queued; the sampled ids (S,) stay on the
                 device, a copy to host memory is queued behind them (and behind their
                 logprobs' copies, when asked); each sampling request's output list gets a
                 PLACEHOLDER where its token will go
    launch(N+1): inputs built (a request fed its in-flight token reads PLACEHOLDER there),
                 then `feed` copies N's ids into those places on the device; the forward pass
                 queued; then N finished (`finish`: wait for the copy, the ids written over the
                 placeholders and into N's output), so that N+1's sampling sees them (penalties
                 read the output lists)

Invariants: at most one step is in flight, and it is finished before the runner samples
again or runs a step synchronously; a placeholder is only ever the last token a request feeds
(the scheduler feeds an in-flight token as a decode step of its own: speculative decoding and
grammars do not run ahead); `done` is set exactly once, by `finish` (or with the error that
stopped the step).
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from tokenmill.attention.input_batch import InputBatch, tensor_on
from tokenmill.core.interface import ModelRunnerOutput, ScheduledRequest
from tokenmill.layers.sampler import pinned_copy
from tokenmill.worker.step_sampling import SampledLogprobs

PLACEHOLDER = -1  # an in-flight token in a runner's output list (never a vocabulary id)


@dataclass
class InFlightStep:
    out: ModelRunnerOutput  # complete but for the sampled tokens
    rows: list[int]  # the rows of `out` that sampled, in the order of `tokens`
    tokens: torch.Tensor  # (S,) int64 on the device: what the next step feeds
    host: torch.Tensor  # (S,) int64: their copy in host memory (pinned on CUDA)
    ready: torch.cuda.Event | None  # recorded after the copy (None: the copy is done)
    lists: list[list[int]]  # each sampled row's output list (the runner's own copy)
    at: list[int]  # where in it the row's PLACEHOLDER stands
    logprobs: SampledLogprobs | None = None  # theirs, copies queued before `ready`
    index: dict[str, int] = field(default_factory=dict)  # req_id → position in tokens
    done: Future[ModelRunnerOutput] = field(default_factory=Future)

    @staticmethod
    def start(out: ModelRunnerOutput, rows: list[int], tokens: torch.Tensor,
              logprobs: SampledLogprobs | None, lists: list[list[int]]) -> InFlightStep:
        """Queue the copy of `tokens` to the host and put a placeholder at the end of each
        sampled row's output list (`lists`, parallel to `rows`); `logprobs`: the tokens'
        logprobs, whose copies are already queued (step_sampling.sample_step)."""
        ready = None
        if tokens.is_cuda:
            host = pinned_copy(tokens)
            ready = torch.cuda.Event()
            ready.record()
        else:
            host = tokens
        at = [len(output_ids) for output_ids in lists]
        for output_ids in lists:
            output_ids.append(PLACEHOLDER)
        index = {out.req_ids[i]: j for j, i in enumerate(rows)}
        return InFlightStep(out, rows, tokens, host, ready, lists, at, logprobs, index)

    def finish(self) -> None:
        """Wait for the ids, write them over the placeholders and into the output; done."""
        if self.done.done():
            return
        if self.ready is not None:
            self.ready.synchronize()
        ids = self.host.tolist()
        for i, output_ids, at, t in zip(self.rows, self.lists, self.at, ids, strict=True):
            output_ids[at] = t  # (a diff reaching it would have known the token: none did)
            self.out.sampled_token_ids[i] = [t]
        if self.logprobs is not None:
            self.logprobs.write(self.out)
        self.done.set_result(self.out)

    def feed(self, batch: InputBatch, reqs: list[ScheduledRequest]) -> int:
        """Copy this step's ids into the next step's input ids where its requests feed them
        (their last token a PLACEHOLDER); the number of ids fed."""
        dst, src = [], []
        for i, r in enumerate(reqs):
            if r.token_ids and r.token_ids[-1] == PLACEHOLDER:
                dst.append(batch.query_start_locs[i + 1] - 1)
                src.append(self.index[r.req_id])
        if dst:
            at = tensor_on(dst + src, self.tokens.device, torch.long)
            n = len(dst)
            batch.input_ids.index_copy_(0, at[:n], self.tokens.index_select(0, at[n:]))
        return len(dst)

