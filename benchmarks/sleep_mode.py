"""Sleep mode through one cycle: `tokenmill serve --enable-sleep-mode` in a process of its own;
its RSS (from /proc) and /health before, asleep (level 1, then level 2) and after waking,
the time each call took, and whether a greedy answer is the same before and after.

    python benchmarks/sleep_mode.py [--model PATH] [engine flags for serve ...]
"""

from __future__ import annotations

import argparse
import time

import httpx

from tokenmill.bench.machine import describe_machine
from tokenmill.bench.serve_command import launch

BODY = {"model": "m", "prompt": "The history of the printing press", "max_tokens": 32,
        "temperature": 0}


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct Q4_1")
    args, extra = ap.parse_known_args()
    print(describe_machine())
    proc, url = launch(args.model, ("--enable-sleep-mode", "--served-model-name", "m", *extra))
    try:
        answer = httpx.post(f"{url}/v1/completions", json=BODY, timeout=300).json()
        before = answer["choices"][0]["text"]
        print(f"{'state':22} {'RSS MiB':>8} {'call s':>7}  /health")
        print(f"{'serving':22} {rss_mib(proc.pid):8.0f} {'':>7}  "
              f"{httpx.get(f'{url}/health').status_code}")
        for level in (1, 2):
            t0 = time.perf_counter()
            httpx.post(f"{url}/sleep", params={"level": level}, timeout=300).raise_for_status()
            took = time.perf_counter() - t0
            health = httpx.get(f"{url}/health")
            print(f"{f'asleep (level {level})':22} {rss_mib(proc.pid):8.0f} {took:7.2f}  "
                  f"{health.status_code} {health.text}")
            status = httpx.post(f"{url}/v1/completions", json=BODY, timeout=60).status_code
            t0 = time.perf_counter()
            httpx.post(f"{url}/wake_up", timeout=300).raise_for_status()
            took = time.perf_counter() - t0
            text = httpx.post(f"{url}/v1/completions", json=BODY,
                              timeout=300).json()["choices"][0]["text"]
            print(f"{'awake again':22} {rss_mib(proc.pid):8.0f} {took:7.2f}  "
                  f"{httpx.get(f'{url}/health').status_code}; a request while asleep got "
                  f"{status}; same answer: {text == before}")
    finally:
        proc.terminate()
        proc.wait()


if __name__ == "__main__":
    main()
