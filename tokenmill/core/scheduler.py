"""Scheduler: iteration-level continuous batching under a per-step token budget.

Each step, running requests go first (in admission order), then waiting requests (FCFS) while
budget, sequence slots and KV blocks last (a request whose LoRA adapter has no place is passed
over: core/lora_policy.py). Under the priority policy (core/scheduling_policy.py) both lists
are in (priority, arrival) order instead, and a full batch gives up its lowest-priority
request to a waiting one of higher priority. A request is given
`min(num_tokens - num_computed_tokens, budget left)` tokens, so prefill chunks, decodes and
resumed requests are one case. When `allocate_slots` returns None the most recently admitted
running request is preempted: its blocks are freed, `num_computed_tokens` drops to 0 and it
goes back to the head of the queue to be recomputed (only past its cached prefix, when prefix
caching is on), or with preemption_mode="swap" its KV is copied to CPU swap space and back;
its generated tokens are kept, so its output does not change. No request is admitted in a step
that preempted, so swap-outs and swap-ins never meet in one step.

Parallel sampling (n > 1): the first sample (the leader) is queued alone; the others wait in
`SampleGroups` (core/sample_groups.py) until they fork the leader's prompt blocks.

The policies are objects of their own, each with its state and tests: admission of waiting
requests (core/admission.py: cache hits, swap-ins, prefill budgeting), LoRA adapters
(core/lora_policy.py: at most max_loras per step, a waiting adapter passed over only by work
queued before it), speculative drafts
(core/spec_policy.py: drafts, a draft model's lookahead, acceptance and its counters) and
structured outputs (core/grammar_policy.py: grammar checks of appended tokens, drafts cut at
the first refused one, jump-forward). An embedding request (pooling) ends when its prompt is
computed: it samples nothing.

Async scheduling (SchedulerConfig.async_scheduling): the engine schedules step N+1 before step
N's tokens come back, so a request whose sampled token is in flight counts it as a placeholder
(`Request.num_output_placeholders`) and is scheduled to feed it; the runner feeds the token it
sampled itself. Not scheduled ahead: a request whose placeholder may be its last token
(max_tokens, max_model_len), one with a grammar (its matcher needs the token), and a preempted
one (it resumes from the tokens the scheduler knows).

Pipeline parallelism (`pipeline_depth` stages): the engine keeps a step in flight per stage; a
request with a step in flight is skipped until that step's output is applied, so the steps in
flight are of different requests, and a step takes at most 1 / depth of the requests, so that
in steady decoding every stage has a micro-batch to work on.

Invariant: every block in the pool is free when no request is running or waiting.
"""

from __future__ import annotations

import time
from collections import deque
from typing import TYPE_CHECKING

from tokenmill.core.admission import Admission
from tokenmill.core.grammar_policy import GrammarPolicy
from tokenmill.core.interface import (
    CachedRequestData,
    ModelRunnerOutput,
    RequestStep,
    SchedulerOutput,
)
from tokenmill.core.kv_cache_manager import KVCacheManager
from tokenmill.core.lora_policy import LoRAPolicy
from tokenmill.core.request import Request, RequestStatus
from tokenmill.core.runner_view import RunnerView
from tokenmill.core.sample_groups import SampleGroups
from tokenmill.core.scheduling_policy import SchedulingPolicy
from tokenmill.core.spec_policy import SpecPolicy
from tokenmill.core.stop import check_stop
from tokenmill.spec_decode import SpeculativeConfig
from tokenmill.spec_decode.policy import SpecCosts
from tokenmill.utils import cdiv

if TYPE_CHECKING:
    from tokenmill.config import SchedulerConfig


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager, max_model_len: int,
                 speculative: SpeculativeConfig | None = None,
                 spec_costs: SpecCosts | None = None, jump_forward: bool = True,
                 pipeline_depth: int = 1, max_loras: int | None = None) -> None:
        self.config = config
        # pipeline parallelism: requests whose step is in flight are not scheduled again until
        # its output is applied (the stages hold no sampled token the scheduler has not seen)
        self.pipeline_depth = pipeline_depth
        self._stepping: set[str] = set()
        self.spec = SpecPolicy(speculative, spec_costs)
        self.grammar = GrammarPolicy(jump_forward)
        self.admission = Admission(kv, config.enable_chunked_prefill)
        self.lora = LoRAPolicy(max_loras)
        self.order = SchedulingPolicy(config.scheduling_policy)
        self.kv = kv
        self.max_model_len = max_model_len
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = self.order.new_queue()
        self.running: list[Request] = []
        self._finished_since_last_step: set[str] = set()
        self._groups = SampleGroups()  # n > 1: samples waiting for their leader's prompt
        self.num_preemptions = 0  # total, for stats and tests
        self.num_prompt_tokens_computed = 0  # prefill work done (cache hits are not counted)
        self._swap_out: list[tuple[int, int]] = []  # (gpu, cpu) block copies for the runner
        self.runner_view = RunnerView()  # what the runner holds: each step sends a diff

    # ---- queue management -------------------------------------------------------------------
    def add_request(self, request: Request, followers: list[Request] | None = None) -> None:
        """Queue a request; `followers` are further samples of the same prompt (n > 1)."""
        for r in [request, *(followers or [])]:
            if r.request_id in self.requests:
                raise ValueError(f"request id {r.request_id!r} is already in use")
        for r in [request, *(followers or [])]:
            self.lora.on_add(r)
        for r in [request, *(followers or [])]:
            self.spec.on_add(r)
        self.requests[request.request_id] = request
        self.waiting.append(request)
        if followers:
            self._groups.add(request, followers)
            for f in followers:
                self.requests[f.request_id] = f

    def abort_request(self, request_id: str) -> Request | None:
        """Finish a request as aborted and free its blocks; None if it is unknown or done."""
        return self.finish_request(request_id, RequestStatus.FINISHED_ABORTED)

    def finish_request(self, request_id: str, status: RequestStatus) -> Request | None:
        """End a request from outside a step (abort, stop string); None if unknown or done."""
        request = self.requests.get(request_id)
        if request is None:
            return None
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        elif not self._groups.remove_follower(request_id):
            self.waiting.remove(request)
        self._finish(request, status)
        return request

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running or self._groups)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    # ---- one step ---------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        scheduled: list[tuple[Request, int, int]] = []  # (request, tokens, lookahead)
        preempted: list[Request] = []
        self.order.order_running(self.running)
        preempted += self._displace()

        spec_room = self.spec.step_tokens - len(self.running)
        # pipeline parallelism: this step's share of the requests (a micro-batch per stage)
        cap = (cdiv(len(self.running) + len(self.waiting), self.pipeline_depth)
               if self.pipeline_depth > 1 else self.config.max_num_seqs)
        i = 0
        while i < len(self.running) and budget > 0 and len(scheduled) < cap:
            request = self.running[i]
            n = (0 if request.request_id in self._stepping
                 else self._num_new_tokens(request, budget))
            if n == 0:  # waiting for its token in flight
                i += 1
                continue
            drafts, lookahead = self._speculation(request, n, min(spec_room, budget - n))
            while self.kv.allocate_slots(request, n + len(drafts) + lookahead) is None:
                victim = self.running.pop()  # the last in self.order's order
                self._preempt(victim)
                preempted.append(victim)
                if victim is request:
                    break
            if request.status != RequestStatus.RUNNING:
                break  # it preempted itself: nobody after it can run either
            request.spec_token_ids = drafts
            spec_room -= len(drafts)
            scheduled.append((request, n, lookahead))
            budget -= n + len(drafts)
            i += 1

        self.lora.new_scan()
        w = 0  # the first waiting request not passed over for its LoRA adapter
        while (not preempted and w < len(self.waiting) and budget > 0 and len(scheduled) < cap
               and len(self.running) < self.config.max_num_seqs):
            request = self.waiting[w]
            if not self.lora.may_start(request, self.running):
                w += 1
                continue
            n = self._admit(request, budget)
            if n is None and self.admission.waits_for_kv:
                w += 1
                continue
            if n is None:
                break
            del self.waiting[w]
            self.lora.on_start(request)
            if request.first_scheduled_time is None:
                request.first_scheduled_time = time.monotonic()
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            scheduled.append((request, n, 0))
            budget -= n

        return self._make_output(scheduled, preempted)

    def _speculation(self, request: Request, n: int, room: int) -> tuple[list[int], int]:
        """A running request's drafts this step (at most `room`) and a draft model's
        lookahead after it; none without a speculative config."""
        if self.spec.speculative is None or request.has_long_bad_words:
            return [], 0
        left = self._tokens_left(request)
        drafts = self.grammar.cut(request, self.spec.drafts(request, n, room, left))
        return drafts, self.spec.lookahead(request, n, len(self.running), left)

    def _displace(self) -> list[Request]:
        """Priority policy: running requests preempted so that waiting ones of a higher
        priority find a place in a full batch."""
        victims = self.order.displaced(self.waiting, self.running, self.config.max_num_seqs)
        for victim in victims:
            self._preempt(victim)
        return victims

    def _num_new_tokens(self, request: Request, budget: int) -> int:
        """Tokens a running request computes this step (its placeholders fed as tokens), or 0
        while its placeholder may end it or its grammar needs the token first."""
        ahead = request.num_output_placeholders
        if ahead and (self.grammar.needs_token_first(request) or request.has_long_bad_words
                      or self._tokens_left(request) <= ahead):
            return 0
        return min(request.num_tokens + ahead - request.num_computed_tokens, budget)

    def _tokens_left(self, request: Request) -> int:
        return min(request.max_tokens - request.num_output_tokens,
                   self.max_model_len - request.num_tokens)

    def _admit(self, request: Request, budget: int) -> int | None:
        """The tokens a waiting request computes this step (core/admission.py), or None if it
        cannot start now (also while a step of it is in flight)."""
        if request.num_output_placeholders or request.request_id in self._stepping:
            return None
        return self.admission.admit(request, budget)

    def _make_output(self, scheduled: list[tuple[Request, int, int]],
                     preempted: list[Request]) -> SchedulerOutput:
        out = SchedulerOutput(finished_req_ids=self._finished_since_last_step,
                              blocks_to_copy=self.kv.take_pending_copies(),
                              blocks_to_swap_out=self._swap_out,
                              blocks_to_swap_in=self.admission.take_swap_in(),
                              kv_offload=self.kv.take_offload_ops(),
                              preempted_req_ids=[r.request_id for r in preempted])
        self._finished_since_last_step, self._swap_out = set(), []
        for request, n, lookahead in scheduled:
            start = request.num_computed_tokens
            self.num_prompt_tokens_computed += max(0, min(start + n, request.num_prompt_tokens)
                                                   - start)
            diff = self.runner_view.diff(request, self.kv)
            if diff is not None:
                (out.cached_requests if isinstance(diff, CachedRequestData)
                 else out.new_requests).append(diff)
            drafts = request.spec_token_ids
            ahead = request.num_output_placeholders
            # an embedding request samples nothing: it ends when its prompt is computed
            sample = start + n == request.num_tokens + ahead and request.pooling_params is None
            step = RequestStep(req_id=request.request_id, start_pos=start, num_new_tokens=n,
                               sample=sample, banned_token_ids=request.banned_token_ids(ahead),
                               num_lookahead_tokens=lookahead, pooling=request.pooling_type)
            if drafts:
                step.spec_token_ids = drafts
                step.spec_banned_token_ids = [request.banned_token_ids(j)
                                              for j in range(1, len(drafts) + 1)]
                if request.proposed_probs is not None:
                    step.spec_draft_probs = request.proposed_probs[:len(drafts)]
            out.scheduled.append(step)
            # NOTE: advanced here, not after the forward pass, so the next schedule() sees the
            # tokens in flight (drafts included); update_from_output appends sampled tokens
            # and rolls back rejected drafts.
            request.num_computed_tokens = start + n + len(drafts)
            request.num_output_placeholders += sample
            if self.pipeline_depth > 1:
                self._stepping.add(request.request_id)
            self._groups.maybe_fork(request, self.kv, self.waiting)
        return out

    def _preempt(self, request: Request) -> None:
        """Swap the request out if configured and there is swap space, else recompute later."""
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.runner_view.forget(request.request_id)  # its blocks move: it comes back as new
        self.waiting.appendleft(request)
        if self.config.preemption_mode == "swap":
            copies = self.kv.swap_out(request)
            if copies is not None:
                self._swap_out += copies
                request.status = RequestStatus.SWAPPED
                return
        self.kv.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0

    def update_from_output(self, sched_out: SchedulerOutput,
                           runner_out: ModelRunnerOutput) -> list[Request]:
        """Append sampled tokens, finish stopped requests; return the requests that progressed."""
        progressed = []
        if self.kv.offload is not None:
            self.kv.offload.apply(runner_out.kv_offload)
        if self._stepping:  # (pipeline parallelism only)
            self._stepping.difference_update(r.req_id for r in sched_out.scheduled)
        for req_id, token_ids in zip(runner_out.req_ids, runner_out.sampled_token_ids,
                                     strict=True):
            request = self.requests.get(req_id)
            if request is None or not token_ids:
                continue  # aborted during the step, or a partial prefill chunk
            request.num_output_placeholders -= 1
            self.spec.on_verified(request, len(token_ids))
            request.proposed_token_ids = runner_out.draft_token_ids.get(req_id, [])
            request.proposed_probs = runner_out.draft_probs.get(req_id)
            status = None
            for token_id in token_ids:
                if (status := self._append(request, token_id)) is not None:
                    break
            if status is None and request.grammar is not None:
                status = self.grammar.jump(request, self._tokens_left(request), self._append)
            if status is not None:
                # preempted after it was scheduled (async scheduling): it waits
                (self.running if request.status == RequestStatus.RUNNING
                 else self.waiting).remove(request)
                self._finish(request, status)
            progressed.append(request)
        for step in sched_out.scheduled:  # embedding requests whose prompt is computed
            request = self.requests.get(step.req_id)
            if (request is not None and request.pooling_params is not None
                    and request.num_computed_tokens >= request.num_prompt_tokens):
                # (swapped out after it was scheduled, async scheduling: it waits, done)
                (self.running if request.status == RequestStatus.RUNNING
                 else self.waiting).remove(request)
                self._finish(request, RequestStatus.FINISHED_STOPPED)
                progressed.append(request)
        return progressed

    def _append(self, request: Request, token_id: int) -> RequestStatus | None:
        """Append an emitted token; the finished status it puts the request in, or None."""
        request.append_output_token(token_id)
        return self.grammar.accept(request, token_id) or check_stop(request, self.max_model_len)

    def _finish(self, request: Request, status: RequestStatus) -> None:
        self._groups.release(request, self.waiting)
        self.spec.on_finish(request)
        self.lora.on_finish(request)
        request.status = status
        self.kv.free(request)
        self.runner_view.forget(request.request_id)
        del self.requests[request.request_id]
        self._finished_since_last_step.add(request.request_id)
