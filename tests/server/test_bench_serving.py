"""The serving load generator against a real tiny server: every request succeeds, token counts
are exact, latencies are ordered, Poisson and fixed-concurrency modes both run, and failures
(an over-long request) are counted, not hidden."""

from __future__ import annotations

import asyncio

from tokenmill.bench.serving import format_table, plot_sweep, run_load, summarize
from tokenmill.bench.workloads import BenchRequest


def test_load_generator_counts_and_latencies(tiny_server, tmp_path):
    reqs = [BenchRequest(list(range(100, 100 + 10 * (i + 1))), 5 + i) for i in range(6)]
    summaries = []
    for conc, rate in ((1, None), (3, None), (None, 50.0)):
        results, duration = asyncio.run(run_load(tiny_server.base_url, "tiny-llama", reqs,
                                                 concurrency=conc, request_rate=rate))
        assert all(r.ok for r in results), [r.error for r in results]
        assert [r.output_tokens for r in results] == [r.output_len for r in reqs]
        for r in results:
            # gaps between chunks that carry text: a token completing no character adds none
            assert 0 < r.ttft <= r.e2e and 1 <= len(r.itl) <= r.output_tokens - 1
            # every event: the text chunks, the usage chunk and [DONE]
            assert r.events >= len(r.itl) + 3
        s = summarize(f"c={conc}", results, duration, conc or 6, rate)
        assert s.failed == 0 and s.output_throughput > 0
        assert s.events == sum(r.events for r in results)
        assert s.ttft_ms["p50"] <= s.ttft_ms["p99"] and s.e2e_ms["p99"] >= s.ttft_ms["p99"]
        summaries.append(s)
    assert "c=1" in format_table(summaries)
    plot_sweep(summaries, str(tmp_path / "sweep.png"), "tiny")
    assert (tmp_path / "sweep.png").stat().st_size > 1000
    tiny_server.wait_idle()


def test_load_generator_reports_failures(tiny_server):
    reqs = [BenchRequest([5] * 10, 4), BenchRequest([5] * 500, 100)]  # the 2nd exceeds 512
    results, duration = asyncio.run(run_load(tiny_server.base_url, "tiny-llama", reqs,
                                             concurrency=2))
    assert [r.ok for r in results] == [True, False] and "400" in results[1].error
    assert summarize("x", results, duration, 2, None).failed == 1
