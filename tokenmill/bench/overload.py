"""Overload run: many simultaneous requests against `tokenmill serve` with a bounded queue.

    python benchmarks/overload.py [--requests 1000] [--max-waiting-requests 256]
                                  [--max-tokens 32] [--model PATH]

Starts `tokenmill serve` in its own process (default settings, max_num_seqs 256, the given
queue bound), sends every request at once (non-streaming completions of `--max-tokens`
tokens), each on a connection of its own, and while they run probes /health every 50 ms
from a process of its own (the load's client shares the machine, not the prober's loop).
Prints how many were admitted (200) and refused (429 with Retry-After, or 503; OpenAI's
error shape), the latency of the admitted ones (p50 / p99) and of the refusals, and /health's
latency during the run (p50 / p99 / max). Every other status, and a connection closed with
no answer, is a failure.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import httpx

from tokenmill.bench.serving import percentile as _pct


@dataclass
class OverloadResult:
    statuses: Counter = field(default_factory=Counter)
    admitted_s: list[float] = field(default_factory=list)
    refused_s: list[float] = field(default_factory=list)
    health_s: list[float] = field(default_factory=list)
    retry_after: set[str] = field(default_factory=set)
    duration_s: float = 0.0


def _probe_health(base_url: str, ready: Any, stop: Any, out: Any) -> None:
    """GET /health every 50 ms until `stop` is set (`ready` once the first one answered); the
    latencies (s) go to `out`, a failed probe as inf. A process of its own: the load's client
    must not delay the probes."""
    times = []
    with httpx.Client(base_url=base_url, timeout=60) as c:
        c.get("/health")
        ready.set()
        while not stop.is_set():
            t0 = time.perf_counter()
            try:
                ok = c.get("/health").status_code == 200
            except httpx.HTTPError:
                ok = False
            times.append(time.perf_counter() - t0 if ok else float("inf"))
            time.sleep(0.05)
    out.put(times)


async def overload(base_url: str, num_requests: int, max_tokens: int,
                   prompt_words: int = 0) -> OverloadResult:
    """Every request at once, each on a connection of its own; /health probed meanwhile.
    prompt_words: that many more words in each prompt (long prefills keep the engine busy)."""
    result = OverloadResult()
    ctx = multiprocessing.get_context("spawn")
    ready, stop, times = ctx.Event(), ctx.Event(), ctx.Queue()
    prober = ctx.Process(target=_probe_health, args=(base_url, ready, stop, times),
                         daemon=True)
    prober.start()
    await asyncio.get_running_loop().run_in_executor(None, ready.wait, 120)

    async def one(c: httpx.AsyncClient, i: int) -> None:
        t0 = time.perf_counter()
        try:
            r = await c.post("/v1/completions", json={
                "prompt": f"Request {i}: tell me a story" + " once" * prompt_words,
                "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0})
        except httpx.HTTPError as e:  # no answer at all: a failure of the run
            result.statuses[f"no response ({type(e).__name__})"] += 1
            return
        elapsed = time.perf_counter() - t0
        result.statuses[r.status_code] += 1
        if r.status_code == 200:
            result.admitted_s.append(elapsed)
        elif r.status_code in (429, 503):
            result.refused_s.append(elapsed)
            result.retry_after.add(r.headers.get("retry-after", "missing"))
            if "error" not in r.json():
                result.statuses["refusal not in OpenAI's error shape"] += 1

    limits = httpx.Limits(max_connections=num_requests + 8, max_keepalive_connections=0)
    try:
        async with httpx.AsyncClient(base_url=base_url, timeout=600, limits=limits) as c:
            start = time.perf_counter()
            await asyncio.gather(*(one(c, i) for i in range(num_requests)))
            result.duration_s = time.perf_counter() - start
    finally:  # the prober stops with the run, however it ends
        stop.set()
    result.health_s = times.get(timeout=60)
    prober.join(timeout=30)
    return result


def format_result(r: OverloadResult, num_requests: int, bound: int) -> str:
    statuses = ", ".join(f"{k}: {v}" for k, v in sorted(r.statuses.items()))
    return "\n".join([
        f"{num_requests} simultaneous requests, queue bound {bound}: {statuses} "
        f"in {r.duration_s:.1f} s",
        f"admitted (200): {len(r.admitted_s)}, latency p50 {_pct(r.admitted_s, 50):.2f} s, "
        f"p99 {_pct(r.admitted_s, 99):.2f} s",
        f"refused (429): {len(r.refused_s)}, latency p50 {_pct(r.refused_s, 50) * 1e3:.0f} ms, "
        f"p99 {_pct(r.refused_s, 99) * 1e3:.0f} ms, Retry-After {sorted(r.retry_after)}",
        f"/health during the run ({len(r.health_s)} probes): p50 "
        f"{_pct(r.health_s, 50) * 1e3:.1f} ms, p99 {_pct(r.health_s, 99) * 1e3:.1f} ms, max "
        f"{max(r.health_s, default=float('nan')) * 1e3:.1f} ms"])


def main(argv: list[str] | None = None) -> int:
    from tokenmill.bench.machine import describe_machine
    from tokenmill.bench.serve_command import launch

    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct")
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--max-waiting-requests", type=int, default=256)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--prompt-words", type=int, default=0,
                    help="words added to each prompt (longer prefills)")
    args = ap.parse_args(argv)
    print(describe_machine())
    proc, base = launch(args.model, ("--max-waiting-requests", str(args.max_waiting_requests),
                                     "--max-num-seqs", str(args.max_num_seqs)))
    try:
        r = asyncio.run(overload(base, args.requests, args.max_tokens, args.prompt_words))
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    print(format_result(r, args.requests, args.max_waiting_requests))
    bad = {k: v for k, v in r.statuses.items() if k not in (200, 429, 503)}
    if bad:
        print(f"FAIL: unexpected statuses {bad}")
    return 1 if bad else 0
