"""LoggingStatLogger: the server's periodic line of what the engine did (vLLM's
LoggingStatLogger, which `--disable-log-stats` turns off), e.g.

    Avg prompt throughput: 812.4 tokens/s, Avg generation throughput: 95.1 tokens/s,
    Running: 12 reqs, Waiting: 0 reqs, KV cache usage: 7.4%, Prefix cache hit rate: 33.0%

Throughputs and the hit rate are over the interval since the last line: prompt tokens
computed (a prefix-cache hit is not computed), tokens generated, and the prompt tokens that
admitted requests found cached. Running, waiting and KV usage are as of the last step.
With speculative decoding a second line gives the interval's draft acceptance.

Engine threads `record` each step (with data parallelism, every replica its own); the
server's event loop calls `log` every interval. As vLLM's, it says nothing while idle, after
one line that shows the engine has gone idle.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

from tokenmill.metrics.stats import SchedulerStats, StepTimings

logger = logging.getLogger(__name__)

DEFAULT_INTERVAL_S = 10.0  # vLLM's VLLM_LOG_STATS_INTERVAL


@dataclass
class _Totals:
    """What the engine has done since start (the totals are those of SchedulerStats)."""

    prompt_computed: int = 0
    generated: int = 0
    queries: int = 0
    hits: int = 0
    draft_tokens: int = 0
    accepted: int = 0


class LoggingStatLogger:
    def __init__(self, interval_s: float = DEFAULT_INTERVAL_S) -> None:
        self.interval_s = interval_s
        self._lock = threading.Lock()  # replicas record from their own engine threads
        self._replicas: dict[int, SchedulerStats] = {}
        self._generated = 0  # tokens since start, all replicas
        self._logged = _Totals()  # the totals at the last line
        self._logged_at = time.monotonic()
        self._last_line_active = False

    def record(self, stats: SchedulerStats, step: StepTimings, replica: int = 0) -> None:
        """A step's stats (the engine thread's `on_step`)."""
        with self._lock:
            self._replicas[replica] = stats
            self._generated += step.generation_tokens

    def lines(self, now: float | None = None) -> list[str]:
        """The lines for the interval ending `now` (none while idle after an idle line);
        the interval restarts."""
        now = time.monotonic() if now is None else now
        with self._lock:
            if not self._replicas:
                return []
            stats = SchedulerStats.combine(list(self._replicas.values()))
            totals = _Totals(stats.num_prompt_tokens_computed, self._generated,
                             stats.prefix_cache_queries, stats.prefix_cache_hits,
                             stats.spec_decode_num_draft_tokens,
                             stats.spec_decode_num_accepted_tokens)
        last, seconds = self._logged, max(now - self._logged_at, 1e-9)
        self._logged, self._logged_at = totals, now
        active = (totals != last or stats.num_running > 0 or stats.num_waiting > 0)
        if not active and not self._last_line_active:
            return []
        self._last_line_active = active
        queries = totals.queries - last.queries
        hit_rate = (totals.hits - last.hits) / queries if queries else 0.0
        prompt_rate = (totals.prompt_computed - last.prompt_computed) / seconds
        generation_rate = (totals.generated - last.generated) / seconds
        out = [f"Avg prompt throughput: {prompt_rate:.1f} tokens/s, "
               f"Avg generation throughput: {generation_rate:.1f} tokens/s, "
               f"Running: {stats.num_running} reqs, Waiting: {stats.num_waiting} reqs, "
               f"KV cache usage: {100 * stats.kv_cache_usage:.1f}%, "
               f"Prefix cache hit rate: {100 * hit_rate:.1f}%"]
        drafted = totals.draft_tokens - last.draft_tokens
        if drafted:
            accepted = totals.accepted - last.accepted
            out.append(f"Speculative decoding: {accepted} of {drafted} draft tokens accepted "
                       f"({100 * accepted / drafted:.1f}%)")
        return out

    def log(self) -> None:
        for line in self.lines():
            logger.info("%s", line)
