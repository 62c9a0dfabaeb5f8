"""RequestStates: the model runner's persistent copy of the requests it runs (vLLM v1's
CachedRequestState), kept up to date from each step's `SchedulerOutput` diffs.

`update(sched)` drops finished and preempted requests, adds new ones and applies the cached
diffs, in that order (core/interface.py); `resolve(step)` turns a `RequestStep` into the
`ScheduledRequest` the rest of the runner reads: the tokens to feed, the block table, the
sampling parameters and the prompt / output lists (the runner's own, read-only there).

The runner also appends the tokens it sampled (`append_sampled`): with async scheduling the
next step is scheduled before the scheduler knows them, and feeds them from here. A diff writes
its tokens at their absolute indices and never cuts the list, so tokens the runner appended
itself survive a diff that does not reach them, and are overwritten by the same values when
one does.

Invariant: after `update(sched)`, each held request's prompt + outputs start with the
scheduler's (they equal them with synchronous steps; with async scheduling the runner may hold
its in-flight token too) and its block table equals the scheduler's. Applying a diff twice
changes nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

from tokenmill.core.interface import RequestStep, ScheduledRequest, SchedulerOutput
from tokenmill.lora.request import AdapterRef
from tokenmill.sampling_params import SamplingParams


@dataclass
class CachedRequestState:
    req_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: list[int]
    lora: AdapterRef | None = None

    def token_slice(self, start: int, stop: int) -> list[int]:
        """Tokens [start, stop) of prompt + outputs, without joining the two lists."""
        p = len(self.prompt_token_ids)
        if start >= p:
            return self.output_token_ids[start - p:stop - p]
        if stop <= p:
            return self.prompt_token_ids[start:stop]
        return self.prompt_token_ids[start:] + self.output_token_ids[:stop - p]


class RequestStates:
    def __init__(self) -> None:
        self.requests: dict[str, CachedRequestState] = {}

    def update(self, sched: SchedulerOutput) -> None:
        for rid in (*sched.finished_req_ids, *sched.preempted_req_ids):
            self.requests.pop(rid, None)
        for d in sched.new_requests:
            self.requests[d.req_id] = CachedRequestState(
                d.req_id, list(d.prompt_token_ids), list(d.output_token_ids),
                d.sampling_params, list(d.block_ids), d.lora)
        for d in sched.cached_requests:
            state = self.requests[d.req_id]
            num_prompt = len(state.prompt_token_ids)
            if d.token_start < num_prompt:
                raise ValueError(f"request {d.req_id}: a diff may not change its prompt "
                                 f"(token_start {d.token_start} < {num_prompt})")
            start = d.token_start - num_prompt
            state.output_token_ids[start:start + len(d.new_token_ids)] = d.new_token_ids
            del state.block_ids[d.block_start:]
            state.block_ids += d.new_block_ids

    def append_sampled(self, req_ids: list[str], sampled: list[list[int]]) -> None:
        """Tokens this runner sampled in a step (parallel lists; [] for no sample)."""
        for rid, tokens in zip(req_ids, sampled, strict=True):
            if tokens and (state := self.requests.get(rid)) is not None:
                state.output_token_ids += tokens

    def resolve(self, step: RequestStep) -> ScheduledRequest:
        state = self.requests.get(step.req_id)
        if state is None:
            raise KeyError(f"request {step.req_id} was scheduled but never sent to the runner")
        start = step.start_pos
        return ScheduledRequest(
            req_id=step.req_id,
            token_ids=state.token_slice(start, start + step.num_new_tokens)
            + step.spec_token_ids,
            start_pos=start, block_ids=state.block_ids, sample=step.sample,
            sampling_params=state.sampling_params, prompt_token_ids=state.prompt_token_ids,
            output_token_ids=state.output_token_ids, banned_token_ids=step.banned_token_ids,
            spec_token_ids=step.spec_token_ids,
            spec_banned_token_ids=step.spec_banned_token_ids,
            spec_draft_probs=step.spec_draft_probs,
            num_lookahead_tokens=step.num_lookahead_tokens, pooling=step.pooling,
            lora=state.lora)
