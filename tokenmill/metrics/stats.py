"""Statistics the engine reports: a snapshot of the scheduler after a step, and per-request
timings (TTFT, inter-token latency, end-to-end latency, queue time) from each step's progress.

All times are `time.monotonic()` seconds.
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tokenmill.core.kv_cache_manager import KVCacheManager
    from tokenmill.core.scheduler import Scheduler


@dataclass(frozen=True)
class SchedulerStats:
    num_running: int
    num_waiting: int
    kv_cache_usage: float  # fraction of KV blocks in use
    num_preemptions: int  # total since start
    prefix_cache_queries: int = 0  # prompt tokens of admitted requests, total
    prefix_cache_hits: int = 0  # of which served from the prefix cache
    num_prompt_tokens_computed: int = 0  # prefill work actually done, total
    spec_decode_num_drafts: int = 0  # verify events (a request's drafts in one step), total
    spec_decode_num_draft_tokens: int = 0  # draft tokens verified, total
    spec_decode_num_accepted_tokens: int = 0  # of which accepted
    spec_decode_num_accepted_tokens_per_pos: tuple[int, ...] = ()  # by draft position
    # structured outputs: tokens a grammar forced, appended without a model step each, total
    structured_output_jump_forward_tokens: int = 0
    # LoRA: the names of the adapters of running and of waiting requests
    running_lora_adapters: frozenset[str] = frozenset()
    waiting_lora_adapters: frozenset[str] = frozenset()
    # KV tiers and transfer (kv_offload/): (counter, tier, total) triples, e.g.
    # ("hit_tokens", "disk", 512); and whether the disk tier still writes (None: none)
    kv_offload_counters: tuple[tuple[str, str, int], ...] = ()
    kv_disk_tier_available: bool | None = None

    @property
    def spec_decode_mean_accepted_length(self) -> float:
        """Tokens a verify step emits on average: the accepted drafts plus one."""
        return (1 + self.spec_decode_num_accepted_tokens / self.spec_decode_num_drafts
                if self.spec_decode_num_drafts else 0.0)

    @property
    def spec_decode_acceptance_rate(self) -> float:
        return (self.spec_decode_num_accepted_tokens / self.spec_decode_num_draft_tokens
                if self.spec_decode_num_draft_tokens else 0.0)

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries \
            else 0.0

    @staticmethod
    def combine(replicas: list[SchedulerStats]) -> SchedulerStats:
        """Data-parallel replicas' stats as one engine's: counts and totals summed, KV usage
        averaged (the replicas' caches are the same size)."""
        if len(replicas) == 1:
            return replicas[0]
        special = ("kv_cache_usage", "spec_decode_num_accepted_tokens_per_pos",
                   "running_lora_adapters", "waiting_lora_adapters", "kv_offload_counters",
                   "kv_disk_tier_available")
        summed = {f.name: sum(getattr(r, f.name) for r in replicas)
                  for f in dataclasses.fields(SchedulerStats) if f.name not in special}
        per_pos = [r.spec_decode_num_accepted_tokens_per_pos for r in replicas]
        return SchedulerStats(
            **summed, kv_cache_usage=sum(r.kv_cache_usage for r in replicas) / len(replicas),
            spec_decode_num_accepted_tokens_per_pos=tuple(
                map(sum, itertools.zip_longest(*per_pos, fillvalue=0))),
            running_lora_adapters=frozenset().union(*(r.running_lora_adapters
                                                      for r in replicas)),
            waiting_lora_adapters=frozenset().union(*(r.waiting_lora_adapters
                                                      for r in replicas)),
            kv_offload_counters=_summed_counters([r.kv_offload_counters for r in replicas]),
            kv_disk_tier_available=(None if replicas[0].kv_disk_tier_available is None else
                                    all(r.kv_disk_tier_available for r in replicas)))


def _summed_counters(per_replica: list[tuple[tuple[str, str, int], ...]]
                     ) -> tuple[tuple[str, str, int], ...]:
    totals: dict[tuple[str, str], int] = {}
    for counters in per_replica:
        for name, tier, n in counters:
            totals[name, tier] = totals.get((name, tier), 0) + n
    return tuple((name, tier, n) for (name, tier), n in sorted(totals.items()))


def scheduler_stats(sched: Scheduler, kv: KVCacheManager) -> SchedulerStats:
    """The snapshot of a scheduler and its KV cache manager after a step."""
    spec, offload = sched.spec, kv.offload
    return SchedulerStats(
        num_running=sched.num_running, num_waiting=sched.num_waiting,
        kv_cache_usage=kv.usage, num_preemptions=sched.num_preemptions,
        prefix_cache_queries=kv.prefix_queries, prefix_cache_hits=kv.prefix_hits,
        num_prompt_tokens_computed=sched.num_prompt_tokens_computed,
        spec_decode_num_drafts=spec.num_drafts,
        spec_decode_num_draft_tokens=spec.num_draft_tokens,
        spec_decode_num_accepted_tokens=spec.num_accepted_tokens,
        spec_decode_num_accepted_tokens_per_pos=tuple(spec.num_accepted_per_pos),
        structured_output_jump_forward_tokens=sched.grammar.num_jump_forward_tokens,
        running_lora_adapters=frozenset(sched.lora.active_adapters(sched.running)),
        waiting_lora_adapters=frozenset(sched.lora.active_adapters(list(sched.waiting))),
        kv_offload_counters=() if offload is None else offload.counters(),
        kv_disk_tier_available=(None if offload is None or offload.config.disk_dir is None
                                else offload.disk_available))


@dataclass
class RequestTimer:
    arrival_time: float
    first_token_time: float | None = None
    last_token_time: float | None = None


@dataclass
class StepTimings:
    """What one step's outputs add to the request metrics."""

    ttft: list[float] = field(default_factory=list)
    inter_token: list[float] = field(default_factory=list)
    e2e: list[float] = field(default_factory=list)
    queue: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    generation_tokens: int = 0
    finished: int = 0


class RequestTimings:
    """Turns each request's progress into latency observations, accumulated until `take`.

    The engine's output processor reports every step's progress here (new tokens per user
    request, whatever its output kind: a FINAL_ONLY request hands back no output until it
    ends, yet its first token and each step's tokens are timed when they come), so the
    observations are vLLM v1's: TTFT when the first token is back, one inter-token
    observation per later step that produced tokens, end-to-end when it finishes."""

    def __init__(self) -> None:
        self._timers: dict[str, RequestTimer] = {}
        self._step = StepTimings()

    def progress(self, request_id: str, arrival_time: float, scheduled_time: float | None,
                 num_prompt_tokens: int, new_tokens: int, finished: bool, now: float) -> None:
        """A generating request (arrived at `arrival_time`, first scheduled at
        `scheduled_time`) produced `new_tokens` (maybe 0) this step."""
        step = self._step
        t = self._timers.get(request_id)
        if t is None:
            t = self._timers[request_id] = RequestTimer(arrival_time)
        if new_tokens > 0:
            if t.first_token_time is None:
                t.first_token_time = now
                step.ttft.append(now - t.arrival_time)
                step.prompt_tokens += num_prompt_tokens
                self._queued(scheduled_time, t)
            else:  # as in vLLM v1: one observation per step that produced tokens
                step.inter_token.append(now - t.last_token_time)
            t.last_token_time = now
            step.generation_tokens += new_tokens
        if finished:
            self._finished(request_id, t, now)

    def pooled(self, request_id: str, arrival_time: float, scheduled_time: float | None,
               num_prompt_tokens: int, now: float) -> None:
        """An embedding request's prompt is done: its one output."""
        t = self._timers.get(request_id) or RequestTimer(arrival_time)
        self._step.prompt_tokens += num_prompt_tokens
        self._queued(scheduled_time, t)
        self._finished(request_id, t, now)

    def take(self) -> StepTimings:
        """The observations since the last take."""
        step, self._step = self._step, StepTimings()
        return step

    def forget(self, request_id: str) -> None:
        """It ended otherwise (aborted, failed): never observed as finished."""
        self._timers.pop(request_id, None)

    def _queued(self, scheduled_time: float | None, t: RequestTimer) -> None:
        if scheduled_time is not None:
            self._step.queue.append(scheduled_time - t.arrival_time)

    def _finished(self, request_id: str, t: RequestTimer, now: float) -> None:
        self._step.e2e.append(now - t.arrival_time)
        self._step.finished += 1
        self._timers.pop(request_id, None)
