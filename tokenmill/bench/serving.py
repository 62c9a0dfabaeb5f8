"""Serving load generator for any OpenAI-compatible endpoint (tokenmill, vLLM, ...).

Sends the standard `mixed` workload (token-id prompts, `ignore_eos`, streamed completions)
either with Poisson arrivals at --request-rate, or at a fixed concurrency, or over a sweep of
concurrencies; measures per request the time to first token, the gaps between streamed chunks
(inter-token latency) and end-to-end latency; prints p50/p95/p99 and throughput, and saves a
JSON file and a PNG plot of throughput and p99 latency against concurrency.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import asdict, dataclass, field

import httpx
import numpy as np

from tokenmill.bench.workloads import BenchRequest


@dataclass
class RequestResult:
    ok: bool
    prompt_tokens: int
    output_tokens: int = 0
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)
    events: int = 0  # server-sent events received ([DONE] included)
    error: str = ""


@dataclass
class RunSummary:
    label: str
    concurrency: int | None
    request_rate: float | None
    num_requests: int
    failed: int
    duration_s: float
    request_throughput: float
    output_throughput: float
    total_token_throughput: float
    ttft_ms: dict[str, float]
    itl_ms: dict[str, float]
    e2e_ms: dict[str, float]
    events: int = 0  # server-sent events received, all requests
    # a launched server's CPU seconds during the run (serve_command.py): its event loop
    # (main thread) and its other threads
    server_loop_cpu_s: float | None = None
    server_other_cpu_s: float | None = None


async def _one(client: httpx.AsyncClient, url: str, model: str, req: BenchRequest,
               headers: dict[str, str]) -> RequestResult:
    body = {"model": model, "prompt": req.prompt_token_ids, "max_tokens": req.output_len,
            "temperature": 0.0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    result = RequestResult(ok=False, prompt_tokens=len(req.prompt_token_ids))
    start = last = time.perf_counter()
    chunks = 0
    try:
        async with client.stream("POST", url, json=body, headers=headers) as r:
            if r.status_code != 200:
                result.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return result
            async for line in r.aiter_lines():
                result.events += line.startswith("data: ")
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                data = json.loads(line[6:])
                if data.get("usage"):
                    result.output_tokens = data["usage"]["completion_tokens"]
                if not any(c.get("text") for c in data.get("choices", [])):
                    continue
                now = time.perf_counter()
                if chunks == 0:
                    result.ttft = now - start
                else:
                    result.itl.append(now - last)
                last, chunks = now, chunks + 1
        result.e2e = time.perf_counter() - start
        result.output_tokens = result.output_tokens or chunks
        result.ok = True
    except httpx.HTTPError as e:
        result.error = repr(e)
    return result


async def run_load(base_url: str, model: str, reqs: list[BenchRequest], *,
                   concurrency: int | None = None, request_rate: float | None = None,
                   seed: int = 0, api_key: str | None = None
                   ) -> tuple[list[RequestResult], float]:
    """Send every request; at most `concurrency` in flight, arrivals Poisson at request_rate."""
    url = f"{base_url.rstrip('/')}/v1/completions"
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limit = asyncio.Semaphore(concurrency or len(reqs))
    rng = random.Random(seed)
    timeout = httpx.Timeout(None, connect=30)
    async with httpx.AsyncClient(timeout=timeout, limits=httpx.Limits(
            max_connections=concurrency or len(reqs))) as client:

        async def limited(req: BenchRequest) -> RequestResult:
            async with limit:
                return await _one(client, url, model, req, headers)

        start = time.perf_counter()
        tasks = []
        for req in reqs:
            tasks.append(asyncio.create_task(limited(req)))
            if request_rate and request_rate != float("inf"):
                await asyncio.sleep(rng.expovariate(request_rate))
        results = await asyncio.gather(*tasks)
        return results, time.perf_counter() - start


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (numpy's linear interpolation); nan for no values."""
    return float(np.percentile(values, q)) if values else float("nan")


def _percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {"mean": 0.0, "p50": 0.0, "p95": 0.0, "p99": 0.0}
    a = np.asarray(values) * 1000.0
    return {"mean": float(a.mean()), "p50": float(np.percentile(a, 50)),
            "p95": float(np.percentile(a, 95)), "p99": float(np.percentile(a, 99))}


def summarize(label: str, results: list[RequestResult], duration: float,
              concurrency: int | None, request_rate: float | None) -> RunSummary:
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    total = out_tokens + sum(r.prompt_tokens for r in ok)
    return RunSummary(
        label=label, concurrency=concurrency, request_rate=request_rate,
        num_requests=len(results), failed=len(results) - len(ok), duration_s=duration,
        request_throughput=len(ok) / duration, output_throughput=out_tokens / duration,
        total_token_throughput=total / duration,
        ttft_ms=_percentiles([r.ttft for r in ok]),
        itl_ms=_percentiles([x for r in ok for x in r.itl]),
        e2e_ms=_percentiles([r.e2e for r in ok]), events=sum(r.events for r in results))


def format_table(summaries: list[RunSummary]) -> str:
    head = (f"{'run':<14}{'reqs':>6}{'fail':>5}{'time s':>8}{'req/s':>8}{'out tok/s':>10}"
            f"{'tot tok/s':>10}  {'TTFT p50/p95/p99 ms':>22}  {'ITL p50/p95/p99 ms':>20}"
            f"  {'E2E p50/p95/p99 s':>19}")
    lines = [head]
    for s in summaries:
        t, i, e = s.ttft_ms, s.itl_ms, s.e2e_ms
        lines.append(
            f"{s.label:<14}{s.num_requests:>6}{s.failed:>5}{s.duration_s:>8.1f}"
            f"{s.request_throughput:>8.2f}{s.output_throughput:>10.1f}"
            f"{s.total_token_throughput:>10.1f}  "
            f"{t['p50']:>6.0f}/{t['p95']:>6.0f}/{t['p99']:>7.0f}  "
            f"{i['p50']:>5.0f}/{i['p95']:>6.0f}/{i['p99']:>6.0f}  "
            f"{e['p50'] / 1000:>5.1f}/{e['p95'] / 1000:>5.1f}/{e['p99'] / 1000:>6.1f}")
    return "\n".join(lines)


def format_server_cpu(summaries: list[RunSummary]) -> str:
    """The launched server's CPU per run: its event loop's seconds and µs per server-sent
    event (every chunk of every stream), and its other threads' seconds."""
    lines = [f"{'run':<14}{'events':>9}{'event loop s':>14}{'µs / event':>12}"
             f"{'other threads s':>17}"]
    for s in summaries:
        if s.server_loop_cpu_s is None:
            continue
        per_event = s.server_loop_cpu_s / s.events * 1e6 if s.events else float("nan")
        lines.append(f"{s.label:<14}{s.events:>9}{s.server_loop_cpu_s:>14.2f}"
                     f"{per_event:>12.1f}{s.server_other_cpu_s:>17.2f}")
    return "\n".join(lines)


def plot_sweep(summaries: list[RunSummary], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    conc = [s.concurrency for s in summaries]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    ax1.plot(conc, [s.output_throughput for s in summaries], "o-", label="output tokens/s")
    ax1.plot(conc, [s.total_token_throughput for s in summaries], "s--", label="total tokens/s")
    ax1.set(xscale="log", xlabel="concurrent requests", ylabel="tokens / s",
            title="throughput")
    ax1.set_xticks(conc, [str(c) for c in conc])
    ax1.legend()
    for key, label in (("ttft_ms", "TTFT p99"), ("itl_ms", "ITL p99"), ("e2e_ms", "E2E p99")):
        ax2.plot(conc, [getattr(s, key)["p99"] for s in summaries], "o-", label=label)
    ax2.set(xscale="log", yscale="log", xlabel="concurrent requests", ylabel="ms",
            title="p99 latency")
    ax2.set_xticks(conc, [str(c) for c in conc])
    ax2.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def save_json(summaries: list[RunSummary], path: str, meta: dict) -> None:
    with open(path, "w") as f:
        json.dump({"meta": meta, "runs": [asdict(s) for s in summaries]}, f, indent=2)
