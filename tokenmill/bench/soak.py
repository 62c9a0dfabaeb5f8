"""Soak test: many requests against a real server in this process, then the books must balance.

    python benchmarks/soak.py [--requests 10000] [--concurrency 32] [--model PATH] [--seed 0]

The server (`build_app` under the same DrainingServer `tokenmill serve` runs) listens on
127.0.0.1 on a thread of this process, so that at the end the engine's block pool can be
checked directly. The load, from one seeded generator, at bounded concurrency:
- 70% good requests: completions or chat, streamed or not, n in 1..3, 1-24 tokens, greedy or
  seeded sampling;
- 15% bad requests, one of many ways (NaN, overflowing seeds, unknown and unimplemented
  fields, bools as token ids, lone surrogates, 404, 405, malformed JSON, over-long prompts):
  each must get its 4xx;
- 15% aborted by the client: a stream dropped after a few events, or a request given up on
  after a short client timeout.

At the end it checks, and exits non-zero on any failure: no 5xx; no stream that ended
without [DONE] or without a finish_reason per choice; no good request refused; the running /
waiting / KV-usage gauges back to zero; every KV block free and the block pool's integrity
check passing. It prints the status counts and RSS at the start (the KV cache already
resident), after a warm-up and at the end (growth per 1,000 requests after the warm-up).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import httpx

from tokenmill.bench.machine import process_memory_mib

BAD_BODIES: list[tuple[str, bytes | dict[str, Any]]] = [
    ("/v1/completions", b'{"prompt": "x", "temperature": NaN}'),
    ("/v1/completions", {"prompt": "x", "seed": 18446744073709551616}),
    ("/v1/completions", {"prompt": "x", "top_k": 9223372036854775808}),
    ("/v1/completions", {"prompt": [False]}),
    ("/v1/completions", {"prompt": []}),
    ("/v1/completions", {"prompt": "x", "stream": "yes"}),
    ("/v1/completions", {"prompt": "x", "n": 20000}),
    ("/v1/completions", {"prompt": "x", "best_of": 4}),
    ("/v1/completions", {"prompt": "x", "frobnicate": True}),
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}),
    ("/v1/completions", {"prompt": [7] * 100000, "max_tokens": 4}),
    ("/v1/completions", b'{"prompt": "a\\ud800"}'),
    ("/v1/completions", b"{not json"),
    ("/v1/completions", {"prompt": "x", "model": "no-such-model"}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "response_format": {"type": "json_schema", "json_schema": {
                                  "name": "x", "schema": {"type": "strin"}}}}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "tools": [{"type": "function", "function": {
                                  "name": "f", "parameters": {"type": "string"}}}]}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "max_completion_tokens": 0}),
    ("/v1/chat/completions", {"messages": []}),
    ("/tokenize", b'{"prompt": "\\udfff"}'),
    ("/v1/nothing", {}),
]


@dataclass
class SoakReport:
    statuses: Counter = field(default_factory=Counter)
    problems: list[str] = field(default_factory=list)
    good: int = 0
    bad: int = 0
    aborted: int = 0
    rss_mb: dict[str, float] = field(default_factory=dict)
    rss_by_done: list[tuple[int, float]] = field(default_factory=list)  # (requests done, MB)
    duration_s: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.problems


def _good_body(rng: random.Random, i: int) -> tuple[str, dict[str, Any]]:
    common: dict[str, Any] = {"max_tokens": rng.randint(1, 24), "n": rng.choice([1, 1, 2, 3]),
                              "stream": rng.random() < 0.5}
    if rng.random() < 0.5:
        common |= {"temperature": 0.8, "seed": rng.randrange(2**63)}
    else:
        common["temperature"] = 0
    if common["stream"] and rng.random() < 0.5:
        common["stream_options"] = {"include_usage": True}
    words = " ".join(rng.choice(["red", "fox", "sky", "tea", "map"])
                     for _ in range(rng.randint(1, 40)))
    if rng.random() < 0.5:
        return "/v1/completions", common | {"prompt": f"{i}: {words}"}
    return "/v1/chat/completions", common | {"messages": [{"role": "user", "content": words}]}


async def _good(client: httpx.AsyncClient, path: str, body: dict, report: SoakReport) -> None:
    report.good += 1
    if not body.get("stream"):
        r = await client.post(path, json=body)
        report.statuses[r.status_code] += 1
        if r.status_code != 200:
            report.problems.append(f"good request got {r.status_code}: {r.text[:200]}")
        elif any(c["finish_reason"] is None for c in r.json()["choices"]):
            report.problems.append("a choice without finish_reason")
        return
    finished, done = set(), False
    async with client.stream("POST", path, json=body) as r:
        report.statuses[r.status_code] += 1
        if r.status_code != 200:
            report.problems.append(f"good stream got {r.status_code}")
            return
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                continue
            event = json.loads(line[6:])
            if "error" in event:
                report.problems.append(f"error event in a good stream: {event}")
            for c in event.get("choices", []):
                if c.get("finish_reason") is not None:
                    finished.add(c["index"])
    if not done or len(finished) != body["n"]:
        report.problems.append(f"truncated stream: [DONE]={done}, {len(finished)} of "
                               f"{body['n']} choices finished")


async def _bad(client: httpx.AsyncClient, rng: random.Random, report: SoakReport) -> None:
    report.bad += 1
    path, body = rng.choice(BAD_BODIES)
    if isinstance(body, bytes):
        r = await client.post(path, content=body, headers={"content-type": "application/json"})
    else:
        r = await client.post(path, json=body)
    report.statuses[r.status_code] += 1
    if not 400 <= r.status_code < 500:
        report.problems.append(f"bad request {path} {body!r:.80} got {r.status_code}")
    elif "error" not in r.json():
        report.problems.append(f"{r.status_code} not in OpenAI's error shape: {r.text[:200]}")


async def _aborted(client: httpx.AsyncClient, rng: random.Random, i: int,
                   report: SoakReport) -> None:
    report.aborted += 1
    body = {"prompt": f"abort {i}", "max_tokens": 200, "ignore_eos": True,
            "n": rng.choice([1, 2])}
    if rng.random() < 0.5:
        async with client.stream("POST", "/v1/completions", json=body | {"stream": True}) as r:
            report.statuses[r.status_code] += 1
            seen = 0
            async for _ in r.aiter_lines():
                seen += 1
                if seen >= rng.randint(1, 6):
                    break  # leaving the block closes the connection mid-stream
        return
    try:
        r = await client.post("/v1/completions", json=body, timeout=rng.uniform(0.01, 0.3))
        report.statuses[r.status_code] += 1
    except httpx.TimeoutException:
        report.statuses["client timeout"] += 1


async def run_soak(base_url: str, num_requests: int, concurrency: int, seed: int,
                   warmup: int, progress: bool = True) -> SoakReport:
    from tqdm import tqdm

    rng = random.Random(seed)
    bar = tqdm(total=num_requests, desc="soak", unit="req", disable=not progress)
    every, done = max(1, num_requests // 10), 0
    report = SoakReport()
    report.rss_mb["start"] = process_memory_mib()
    sem = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency * 2)
    async with httpx.AsyncClient(base_url=base_url, timeout=120, limits=limits) as client:
        async def one(i: int, kind: float, child: random.Random) -> None:
            async with sem:
                if kind < 0.70:
                    await _good(client, *_good_body(child, i), report)
                elif kind < 0.85:
                    await _bad(client, child, report)
                else:
                    await _aborted(client, child, i, report)
                nonlocal done
                done += 1
                bar.update()
                if done % every == 0:  # does growth level off (caches) or go on (a leak)?
                    report.rss_by_done.append((done, process_memory_mib()))

        start = time.perf_counter()
        plans = [(i, rng.random(), random.Random(rng.getrandbits(64)))
                 for i in range(num_requests)]
        await asyncio.gather(*(one(*p) for p in plans[:warmup]))
        report.rss_mb["after warm-up"] = process_memory_mib()
        await asyncio.gather(*(one(*p) for p in plans[warmup:]))
        report.duration_s = time.perf_counter() - start
    bar.close()
    report.rss_mb["end"] = process_memory_mib()
    return report


def check_idle(base_url: str, engine: Any, report: SoakReport, timeout: float = 30) -> None:
    """Gauges at zero, every block free, block pool integrity: or problems in the report."""
    deadline = time.monotonic() + timeout
    gauges: dict[str, float] = {}
    while time.monotonic() < deadline:
        gauges = {}
        for line in httpx.get(f"{base_url}/metrics").text.splitlines():
            for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"):
                if line.startswith(f"tokenmill:{name}{{"):
                    gauges[name] = float(line.rsplit(" ", 1)[1])
        if (not any(gauges.values()) and not engine.has_unfinished_requests()
                and engine.kv.num_free_blocks == engine.kv.num_usable_blocks):
            break
        time.sleep(0.1)
    if any(gauges.values()):
        report.problems.append(f"gauges not back to zero: {gauges}")
    if engine.kv.num_free_blocks != engine.kv.num_usable_blocks:
        report.problems.append(f"{engine.kv.num_usable_blocks - engine.kv.num_free_blocks} KV "
                               "blocks still in use")
    try:
        engine.kv.check_integrity()
    except AssertionError as e:
        report.problems.append(f"block pool integrity: {e}")


def format_report(report: SoakReport, num_requests: int, warmup: int) -> str:
    lines = [f"requests: {num_requests} ({report.good} good, {report.bad} bad, "
             f"{report.aborted} aborted by the client) in {report.duration_s:.1f} s",
             "statuses: " + ", ".join(f"{k}: {v}" for k, v in sorted(
                 report.statuses.items(), key=lambda kv: str(kv[0])))]
    rss = report.rss_mb
    lines.append("RSS MB: " + ", ".join(f"{k} {v:.0f}" for k, v in rss.items()))
    lines.append("RSS MB by requests done: " + ", ".join(f"{n}: {mb:.0f}"
                                                       for n, mb in report.rss_by_done))
    after = num_requests - warmup
    if after > 0 and "after warm-up" in rss:
        growth = (rss["end"] - rss["after warm-up"]) / after * 1000
        lines.append(f"RSS growth after warm-up: {growth:+.2f} MB per 1,000 requests")
    if len(report.rss_by_done) >= 4:  # caches fill early; a leak keeps growing to the end
        (n0, mb0), (n1, mb1) = report.rss_by_done[len(report.rss_by_done) // 2 - 1], \
            report.rss_by_done[-1]
        lines.append(f"RSS growth over the second half: {(mb1 - mb0) / (n1 - n0) * 1000:+.2f} "
                     "MB per 1,000 requests")
    lines.append("PASS: no 5xx, no truncated stream, gauges at zero, every block free, "
                 "block pool intact" if report.ok else
                 f"FAIL: {len(report.problems)} problems, first: {report.problems[:5]}")
    return "\n".join(lines)


def soak(model: str | None, num_requests: int, concurrency: int, seed: int,
         engine_options: dict[str, Any] | None = None, progress: bool = True) -> SoakReport:
    """Start a server on this process, run the soak against it, check it, stop it."""
    import uvicorn

    from tokenmill.engine.llm_engine import LLMEngine
    from tokenmill.server.api_server import build_app
    from tokenmill.server.lifecycle import DrainingServer

    engine = LLMEngine.from_options(model, **(engine_options or {}))
    # The KV cache's pages are first touched when a block is first used, and the prefix
    # cache keeps used blocks, so over a long run the whole cache becomes resident: that is
    # bounded (--kv-cache-memory), not a leak. Touch it all now so RSS growth shows leaks.
    engine.runner.kv_cache.zero_()
    app = build_app(engine, "soak")
    server = DrainingServer(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"),
                            app.state.server.lifecycle)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    port = server.servers[0].sockets[0].getsockname()[1]
    base = f"http://127.0.0.1:{port}"
    warmup = min(num_requests // 10, 500)
    try:
        report = asyncio.run(run_soak(base, num_requests, concurrency, seed, warmup, progress))
        check_idle(base, engine, report)
        if any(isinstance(k, int) and k >= 500 for k in report.statuses):
            report.problems.append("5xx responses")
    finally:
        server.should_exit = True
        thread.join(timeout=30)
    print(format_report(report, num_requests, warmup))
    return report


def main(argv: list[str] | None = None) -> int:
    from tokenmill.bench.machine import describe_machine

    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct")
    ap.add_argument("--requests", type=int, default=10000)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--kv-cache-memory", default="512MiB")
    args = ap.parse_args(argv)
    print(describe_machine())
    report = soak(args.model, args.requests, args.concurrency, args.seed,
                  {"kv_cache_memory": args.kv_cache_memory})
    return 0 if report.ok else 1
