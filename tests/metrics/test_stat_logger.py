"""The periodic engine line: throughputs over the interval, the last step's counts, the
interval's prefix-cache hit rate, replicas added up, and silence while idle after one idle
line (vLLM's LoggingStatLogger)."""

from __future__ import annotations

from tokenmill.metrics.stat_logger import LoggingStatLogger
from tokenmill.metrics.stats import SchedulerStats, StepTimings


def _stats(running: int, waiting: int = 0, computed: int = 0, queries: int = 0, hits: int = 0,
           usage: float = 0.0, drafts: int = 0, accepted: int = 0) -> SchedulerStats:
    return SchedulerStats(num_running=running, num_waiting=waiting, kv_cache_usage=usage,
                          num_preemptions=0, prefix_cache_queries=queries,
                          prefix_cache_hits=hits, num_prompt_tokens_computed=computed,
                          spec_decode_num_draft_tokens=drafts,
                          spec_decode_num_accepted_tokens=accepted)


def test_the_line_reports_the_interval():
    log = LoggingStatLogger(interval_s=10)
    t0 = log._logged_at
    log.record(_stats(2, computed=300, queries=400, hits=100), StepTimings(generation_tokens=2))
    log.record(_stats(3, waiting=1, computed=500, queries=600, hits=200, usage=0.25),
               StepTimings(generation_tokens=3))
    (line,) = log.lines(now=t0 + 10)
    assert line == ("Avg prompt throughput: 50.0 tokens/s, Avg generation throughput: 0.5 "
                    "tokens/s, Running: 3 reqs, Waiting: 1 reqs, KV cache usage: 25.0%, "
                    "Prefix cache hit rate: 33.3%")
    # the next interval counts from there: 100 more computed, 4 generated, no new queries
    log.record(_stats(1, computed=600, queries=600, hits=200), StepTimings(generation_tokens=4))
    (line,) = log.lines(now=t0 + 20)
    assert line.startswith("Avg prompt throughput: 10.0 tokens/s, Avg generation throughput: "
                           "0.4 tokens/s, Running: 1 reqs")
    assert line.endswith("Prefix cache hit rate: 0.0%")


def test_idle_after_one_idle_line_is_silent():
    log = LoggingStatLogger(interval_s=1)
    t0 = log._logged_at
    assert log.lines(now=t0 + 1) == []  # nothing recorded yet
    log.record(_stats(1, computed=10), StepTimings(generation_tokens=1))
    assert len(log.lines(now=t0 + 2)) == 1
    log.record(_stats(0, computed=10), StepTimings(generation_tokens=1))  # it finished
    assert "Running: 0 reqs" in log.lines(now=t0 + 3)[0]
    assert len(log.lines(now=t0 + 4)) == 1  # one line showing the engine idle
    assert log.lines(now=t0 + 5) == [] and log.lines(now=t0 + 6) == []
    log.record(_stats(0, waiting=1, computed=10), StepTimings())  # a request waits
    assert "Waiting: 1 reqs" in log.lines(now=t0 + 7)[0]


def test_replicas_add_up_and_drafts_get_their_line():
    log = LoggingStatLogger(interval_s=1)
    t0 = log._logged_at
    log.record(_stats(2, computed=100, drafts=10, accepted=6), StepTimings(generation_tokens=5),
               replica=0)
    log.record(_stats(1, computed=50, drafts=10, accepted=2), StepTimings(generation_tokens=5),
               replica=1)
    first, spec = log.lines(now=t0 + 1)
    assert first.startswith("Avg prompt throughput: 150.0 tokens/s, Avg generation throughput: "
                            "10.0 tokens/s, Running: 3 reqs")
    assert spec == "Speculative decoding: 8 of 20 draft tokens accepted (40.0%)"
