"""Prometheus metrics named like vLLM's, under the `tokenmill:` prefix.

Each server owns its own CollectorRegistry (no process-global state), so several engines can
live in one process, as they do in tests.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from tokenmill.metrics.stats import SchedulerStats, StepTimings

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                    5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0)

# KV tiers and transfer, per tier (cpu, disk; shared: the disaggregated prefill transfer)
_OFFLOAD_COUNTERS = {
    "blocks_stored": "KV blocks stored to the tier",
    "blocks_loaded": "KV blocks loaded from the tier into the cache",
    "bytes_stored": "Bytes stored to the tier",
    "bytes_loaded": "Bytes loaded from the tier into the cache",
    "hit_tokens": "Prompt tokens found in the tier",
}


class PrometheusMetrics:
    def __init__(self, model_name: str, kv_capacity_tokens: int | None = None,
                 kv_cache_dtype: str = "auto", max_loras: int | None = None) -> None:
        self.registry = CollectorRegistry()
        r, labels = self.registry, ["model_name"]

        def hist(name: str, doc: str) -> Histogram:
            return Histogram(f"tokenmill:{name}", doc, labels, registry=r,
                             buckets=_LATENCY_BUCKETS).labels(model_name)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(f"tokenmill:{name}", doc, labels, registry=r).labels(model_name)

        def counter(name: str, doc: str) -> Counter:
            return Counter(f"tokenmill:{name}", doc, labels, registry=r).labels(model_name)

        self.ttft = hist("time_to_first_token_seconds", "Time to first token")
        self.itl = hist("inter_token_latency_seconds", "Time between steps producing tokens")
        self.e2e = hist("e2e_request_latency_seconds", "Arrival to finish")
        self.queue = hist("request_queue_time_seconds", "Arrival to first scheduled")
        self.running = gauge("num_requests_running", "Requests in the running batch")
        self.waiting = gauge("num_requests_waiting", "Requests waiting to be scheduled")
        self.kv_usage = gauge("kv_cache_usage_perc", "Fraction of KV cache blocks in use (0-1)")
        if kv_capacity_tokens is not None:  # fixed at start-up: what the KV budget holds
            Gauge("tokenmill:kv_cache_capacity_tokens", "Tokens the KV cache holds",
                  ["model_name", "kv_cache_dtype"], registry=r).labels(
                      model_name, kv_cache_dtype).set(kv_capacity_tokens)
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of started requests")
        self.generation_tokens = counter("generation_tokens", "Generated tokens")
        self.preemptions = counter("num_preemptions", "Requests preempted")
        self.finished = counter("request_success", "Requests finished")
        self.prefix_queries = counter("prefix_cache_queries", "Prompt tokens looked up")
        self.prefix_hits = counter("prefix_cache_hits", "Prompt tokens found in the cache")
        self.prefix_hit_rate = gauge("prefix_cache_hit_rate", "Prefix cache hits / queries")
        self.spec_events = counter("spec_decode_num_drafts", "Verify events (drafts of a "
                                   "request in one step)")
        self.spec_drafts = counter("spec_decode_num_draft_tokens", "Draft tokens verified")
        self.spec_accepted = counter("spec_decode_num_accepted_tokens",
                                     "Draft tokens accepted")
        self.spec_accepted_per_pos = Counter(
            "tokenmill:spec_decode_num_accepted_tokens_per_pos",
            "Draft tokens accepted, by position in the draft", ["model_name", "position"],
            registry=r)
        self.jump_forward = counter("structured_output_jump_forward_tokens",
                                    "Tokens a grammar forced, appended without a model step")
        # vLLM's lora_requests_info: the series labelled with the adapters now, set to the
        # time it was last true (the newest series is the current state)
        self.lora_info = (None if max_loras is None else Gauge(
            "tokenmill:lora_requests_info", "Running stats on LoRA requests",
            ["max_lora", "waiting_lora_adapters", "running_lora_adapters"], registry=r))
        self._max_loras = max_loras
        self._jump_forward_seen = 0
        self._model_name = model_name
        self._per_pos_seen: tuple[int, ...] = ()
        self._preemptions_seen = 0
        self._kv_tier_metrics(counter, gauge)
        self._prefix_seen = (0, 0)
        self._spec_seen = (0, 0, 0)
        self._replicas: dict[int, SchedulerStats] = {}  # each replica's last stats
        self._lock = threading.Lock()  # replicas record from their own engine threads

    def _kv_tier_metrics(self, counter: Callable[[str, str], Counter],
                         gauge: Callable[[str, str], Gauge]) -> None:
        """Prompt tokens computed, and the KV tiers' counters per tier (kv_offload/)."""
        self.prompt_computed = counter("prompt_tokens_computed", "Prompt tokens this "
                                       "instance computed (not found in its cache, a KV tier "
                                       "or a transfer)")
        self._computed_seen = 0
        self.disk_tier_available: bool | None = None  # as last recorded (/health reads it)
        self.offload = {name: Counter(f"tokenmill:kv_offload_{name}", doc,
                                      ["model_name", "tier"], registry=self.registry)
                        for name, doc in _OFFLOAD_COUNTERS.items()}
        self._offload_seen: dict[tuple[str, str], int] = {}
        self.disk_tier_up = gauge("kv_offload_disk_available", "1 while the disk tier writes "
                                  "blocks, 0 once a write failed (a full disk)")

    def record(self, stats: SchedulerStats, step: StepTimings, replica: int = 0) -> None:
        """A step's stats and timings; with data parallelism each replica's engine thread
        calls this with its own stats, and the gauges and counters are of all replicas."""
        with self._lock:
            self._replicas[replica] = stats
            self._record(SchedulerStats.combine(list(self._replicas.values())), step)

    def _record(self, stats: SchedulerStats, step: StepTimings) -> None:
        self.running.set(stats.num_running)
        self.waiting.set(stats.num_waiting)
        self.kv_usage.set(stats.kv_cache_usage)
        if stats.num_preemptions > self._preemptions_seen:
            self.preemptions.inc(stats.num_preemptions - self._preemptions_seen)
            self._preemptions_seen = stats.num_preemptions
        for hist, values in ((self.ttft, step.ttft), (self.itl, step.inter_token),
                             (self.e2e, step.e2e), (self.queue, step.queue)):
            for v in values:
                hist.observe(v)
        queries, hits = stats.prefix_cache_queries, stats.prefix_cache_hits
        self.prefix_queries.inc(queries - self._prefix_seen[0])
        self.prefix_hits.inc(hits - self._prefix_seen[1])
        self._prefix_seen = (queries, hits)
        self.prefix_hit_rate.set(stats.prefix_cache_hit_rate)
        seen = (stats.spec_decode_num_drafts, stats.spec_decode_num_draft_tokens,
                stats.spec_decode_num_accepted_tokens)
        for metric, now, before in zip((self.spec_events, self.spec_drafts, self.spec_accepted),
                                       seen, self._spec_seen, strict=True):
            metric.inc(now - before)
        self._spec_seen = seen
        per_pos = stats.spec_decode_num_accepted_tokens_per_pos
        for pos, now in enumerate(per_pos):
            before = self._per_pos_seen[pos] if pos < len(self._per_pos_seen) else 0
            self.spec_accepted_per_pos.labels(self._model_name, str(pos)).inc(now - before)
        self._per_pos_seen = per_pos
        self.jump_forward.inc(stats.structured_output_jump_forward_tokens
                              - self._jump_forward_seen)
        self._jump_forward_seen = stats.structured_output_jump_forward_tokens
        self.prompt_computed.inc(stats.num_prompt_tokens_computed - self._computed_seen)
        self._computed_seen = stats.num_prompt_tokens_computed
        for name, tier, total in stats.kv_offload_counters:
            self.offload[name].labels(self._model_name, tier).inc(
                total - self._offload_seen.get((name, tier), 0))
            self._offload_seen[name, tier] = total
        if stats.kv_disk_tier_available is not None:
            self.disk_tier_up.set(int(stats.kv_disk_tier_available))
        self.disk_tier_available = stats.kv_disk_tier_available
        self.prompt_tokens.inc(step.prompt_tokens)
        self.generation_tokens.inc(step.generation_tokens)
        self.finished.inc(step.finished)
        if self.lora_info is not None:
            self.lora_info.labels(
                str(self._max_loras), ",".join(sorted(stats.waiting_lora_adapters)),
                ",".join(sorted(stats.running_lora_adapters))).set_to_current_time()

    def render(self) -> bytes:
        return generate_latest(self.registry)
