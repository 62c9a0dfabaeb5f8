"""`tokenmill bench serve` / `python benchmarks/serve.py`: drive the serving load generator.

    tokenmill bench serve --launch                       # start tokenmill serve, sweep 1,4,16,64
    tokenmill bench serve --base-url http://host:8000 --request-rate 2 --num-requests 64
    tokenmill bench serve --base-url ... --concurrency 16

The prompts are token ids from the model at --model-path (default: SmolLM2), so the target
server must serve a model with the same vocabulary. A launched server's CPU time is read
around each run (Linux): its event loop's (the main thread, µs per server-sent event: the HTTP
side of every streamed chunk) and its other threads' (the engine and its compute threads).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import subprocess
import sys
import time
from typing import Any

import httpx

from tokenmill.bench.process_cpu import ProcessCpu, thread_cpu_seconds
from tokenmill.bench.serving import (
    format_server_cpu,
    format_table,
    plot_sweep,
    run_load,
    save_json,
    summarize,
)
from tokenmill.bench.workloads import make_workload


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--launch", action="store_true",
                   help="start `tokenmill serve` on a free port for the run, stop it after")
    p.add_argument("--model-path", default=None,
                   help="model whose vocabulary the prompts use (default: SmolLM2)")
    p.add_argument("--served-model", default=None, help="default: the first of /v1/models")
    p.add_argument("--api-key", default=None)
    p.add_argument("--workload", default="mixed", choices=["mixed", "uniform"])
    p.add_argument("--num-requests", type=int, default=None,
                   help="per run; a sweep defaults to max(4, 2 x concurrency)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--request-rate", type=float, default=None,
                   help="Poisson arrivals per second (inf: all at once)")
    p.add_argument("--concurrency", type=int, default=None, help="fixed concurrency")
    p.add_argument("--sweep", default="1,4,16,64",
                   help="concurrencies to sweep when neither --request-rate nor --concurrency")
    p.add_argument("--out", default="benchmarks/out/serve", help="prefix of .json and .png")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(model_path: str | None, extra_args: tuple[str, ...] = (),
           stderr: Any = subprocess.DEVNULL, timeout: float = 300, command: str = "serve",
           cores: list[int] | None = None) -> tuple[subprocess.Popen, str]:
    """`tokenmill serve` (or `command`: "proxy") on a free port, once /health answers 200:
    (process, base URL). `cores`: pinned to those CPUs (taskset) with as many threads."""
    port = _free_port()
    cmd = [sys.executable, "-m", "tokenmill", command, *([model_path] if model_path else []),
           "--port", str(port), *extra_args]
    env = dict(os.environ)
    if cores is not None:
        env["OMP_NUM_THREADS"] = str(len(cores))
        cmd = ["taskset", "-c", ",".join(map(str, cores)), *cmd]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=stderr, text=True, env=env)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                return proc, base
        except httpx.HTTPError:
            pass
        if proc.poll() is not None:
            raise RuntimeError(f"tokenmill {command} exited during start-up")
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError(f"tokenmill {command} did not become healthy")


def run(args: argparse.Namespace) -> int:
    from tokenmill.config_model import model_config
    from tokenmill.engine.tokenizer import load_tokenizer

    mc = model_config(args.model_path)
    special = set(load_tokenizer(mc).all_special_ids)
    proc, base = launch(args.model_path) if args.launch else (None, args.base_url)
    watch_cpu = proc is not None and ProcessCpu.supported(proc.pid)
    try:
        headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
        model = args.served_model or httpx.get(f"{base}/v1/models",
                                               headers=headers).json()["data"][0]["id"]
        if args.request_rate is not None or args.concurrency is not None:
            plan = [(args.concurrency, args.request_rate)]
        else:
            plan = [(int(c), None) for c in args.sweep.split(",")]
        summaries = []
        for conc, rate in plan:
            n = args.num_requests or (max(4, 2 * conc) if conc and rate is None else None)
            reqs = make_workload(args.workload, mc.vocab_size, special, args.seed, n)
            label = f"c={conc}" if rate is None else f"rate={rate:g}"
            print(f"{label}: {len(reqs)} requests ...", flush=True)
            cpu_before = thread_cpu_seconds(proc.pid) if watch_cpu else {}
            results, duration = asyncio.run(run_load(base, model, reqs, concurrency=conc,
                                                     request_rate=rate, seed=args.seed,
                                                     api_key=args.api_key))
            summaries.append(summary := summarize(label, results, duration, conc, rate))
            if watch_cpu:
                cpu = ProcessCpu.between(proc.pid, cpu_before, thread_cpu_seconds(proc.pid))
                summary.server_loop_cpu_s, summary.server_other_cpu_s = cpu.main_s, cpu.others_s
            errors = [r.error for r in results if not r.ok]
            if errors:
                print(f"  {len(errors)} failed, first: {errors[0]}")
        print(f"\nworkload {args.workload} against {base} ({model})")
        print(format_table(summaries))
        if watch_cpu:
            print(f"\nserver CPU (tokenmill serve, pid {proc.pid}):")
            print(format_server_cpu(summaries))
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        save_json(summaries, f"{args.out}.json", {"base_url": base, "model": model,
                                                  "workload": args.workload})
        if len(summaries) > 1 and all(s.concurrency for s in summaries):
            plot_sweep(summaries, f"{args.out}.png", f"{model}, {args.workload} workload")
            print(f"plot: {args.out}.png")
        return 0 if all(s.failed == 0 for s in summaries) else 1
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=60)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    return run(parser.parse_args(argv))
