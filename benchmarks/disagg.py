"""Disaggregated prefill / decode against one instance, in one run: long prompts (2,048
tokens) arrive while short requests decode; TTFT of the long prompts and inter-token latency
(ITL) of the short streams, percentiles.

- single: one `tokenmill serve` with every core (a 2,048-token prompt is one step);
- single-chunked: the same with `--max-num-batched-tokens 256` (prompts in 256-token chunks
  between the decodes: the single instance's own answer to long prompts);
- disagg: a producer and a consumer (`--kv-transfer-config`, SharedStorageConnector), each
  pinned to its own share of the cores (taskset, OMP_NUM_THREADS), behind `tokenmill proxy`.

On a 2-core machine the split gives each instance one core: the consumer's decode steps no
longer wait behind a 2k-token prefill, but each instance has half the compute. With a machine
per instance, each would keep all of its cores.

    python benchmarks/disagg.py [--model PATH] [--long 6] [--short 4]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import random
import tempfile
import time

import httpx

from tokenmill.bench.machine import describe_machine
from tokenmill.bench.serve_command import launch
from tokenmill.bench.serving import percentile as pct

LONG, SHORT, LONG_OUT, SHORT_OUT = 2048, 32, 16, 160


async def stream(client: httpx.AsyncClient, url: str, prompt: list[int], n: int
                 ) -> list[float]:
    """Arrival times (from the send) of each streamed chunk with text."""
    body = {"model": "m", "prompt": prompt, "max_tokens": n, "temperature": 0,
            "ignore_eos": True, "stream": True}
    start, times = time.perf_counter(), []
    async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if (line.startswith("data: ") and line != "data: [DONE]"
                    and json.loads(line[6:])["choices"]):
                times.append(time.perf_counter() - start)
    return times


async def workload(url: str, n_long: int, n_short: int, vocab: int
                   ) -> tuple[list[float], list[float]]:
    rng = random.Random(0)
    draw = lambda k: [rng.randrange(100, vocab - 100) for _ in range(k)]
    async with httpx.AsyncClient(timeout=None) as client:
        async def long_one(delay: float) -> float:
            await asyncio.sleep(delay)
            return (await stream(client, url, draw(LONG), LONG_OUT))[0]

        shorts = [stream(client, url, draw(SHORT), SHORT_OUT) for _ in range(n_short)]
        longs = [long_one(0.5 + 1.5 * i) for i in range(n_long)]
        results = await asyncio.gather(*shorts, *longs)
    itl = [b - a for times in results[:n_short] for a, b in itertools.pairwise(times)]
    return list(results[n_short:]), itl


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct Q4_1")
    ap.add_argument("--long", type=int, default=6)
    ap.add_argument("--short", type=int, default=4)
    args = ap.parse_args()
    print(describe_machine())
    from tokenmill.config_model import model_config
    vocab = model_config(args.model).vocab_size
    ncores = os.cpu_count() or 2
    serve = ["--served-model-name", "m", "--max-model-len", "4096"]
    rows = []
    with tempfile.TemporaryDirectory(prefix="tm-disagg-") as shared:
        procs = []
        try:
            for mode, extra in (("single", []),
                                ("single-chunked", ["--max-num-batched-tokens", "256"])):
                proc, url = launch(args.model, (*serve, *extra))
                procs.append(proc)
                asyncio.run(workload(url, 1, 1, vocab))  # warm-up
                rows.append((mode, *asyncio.run(workload(url, args.long, args.short, vocab))))
                proc.terminate()
                proc.wait()
            half = max(1, ncores // 2)
            roles = [("kv_producer", list(range(half))),
                     ("kv_consumer", list(range(half, ncores)) or [0])]
            urls = []
            for role, cores in roles:
                transfer = {"kv_connector": "SharedStorageConnector", "kv_role": role,
                            "kv_connector_extra_config": {"shared_storage_path": shared}}
                proc, url = launch(args.model, (*serve, "--kv-transfer-config",
                                                json.dumps(transfer)), cores=cores)
                procs.append(proc)
                urls.append(url)
            proxy, url = launch(None, ("--prefill", urls[0], "--decode", urls[1]),
                                command="proxy")
            procs.append(proxy)
            asyncio.run(workload(url, 1, 1, vocab))
            rows.append(("disagg", *asyncio.run(workload(url, args.long, args.short, vocab))))
        finally:
            for proc in procs:
                proc.terminate()
    print(f"{args.long} prompts of {LONG} tokens ({LONG_OUT} out) every 1.5 s while {args.short} "
          f"streams of {SHORT} + {SHORT_OUT} tokens decode; {ncores} cores")
    print(f"{'mode':14} {'TTFT p50':>9} {'p90':>7} {'ITL p50 ms':>11} {'p90':>7} {'p99':>7} "
          f"{'max':>7}")
    for mode, ttft, itl in rows:
        print(f"{mode:14} {pct(ttft, 50):9.2f} {pct(ttft, 90):7.2f} "
              f"{1e3 * pct(itl, 50):11.1f} {1e3 * pct(itl, 90):7.1f} {1e3 * pct(itl, 99):7.1f} "
              f"{1e3 * max(itl):7.1f}")


if __name__ == "__main__":
    main()
