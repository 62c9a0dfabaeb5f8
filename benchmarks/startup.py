"""Start-up time: `LLM()` until ready, and `tokenmill serve` until /health answers 200.

    python benchmarks/startup.py [--model PATH] [--repeats 3] [--cold] [--port 8123]

Each measurement is a fresh Python process (imports included), timed from its launch. Starts
normally find the converted GGUF copy (model_loader/gguf_cache.py) in its cache and the CPU
kernels compiled at install time (utils/cpp_extension.py); --cold first measures one `LLM()`
and one `tokenmill serve` with the caches empty (temporary TOKENMILL_CACHE_DIR and
TORCH_EXTENSIONS_DIR): the first start after the README's install command.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

LLM_SNIPPET = ("import sys; from tokenmill import LLM; LLM(sys.argv[1] if len(sys.argv) > 1 "
               "else None); print('READY', flush=True)")


def time_llm(model: str | None, env: dict[str, str]) -> float:
    start = time.perf_counter()
    args = [sys.executable, "-c", LLM_SNIPPET] + ([model] if model else [])
    out = subprocess.run(args, env=env, capture_output=True, text=True, check=True)
    assert "READY" in out.stdout, out.stderr[-2000:]
    return time.perf_counter() - start


def time_serve(model: str | None, port: int, env: dict[str, str], timeout: float = 300) -> float:
    args = [sys.executable, "-m", "tokenmill.cli", "serve", *([model] if model else []),
            "--port", str(port)]
    start = time.perf_counter()
    proc = subprocess.Popen(args, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        while time.perf_counter() - start < timeout:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited: {proc.stderr.read().decode()[-2000:]}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as r:
                    if r.status == 200:
                        return time.perf_counter() - start
            except OSError:
                time.sleep(0.05)
        raise TimeoutError("server did not become healthy")
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct GGUF")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--cold", action="store_true", help="also time one start with empty caches")
    ap.add_argument("--port", type=int, default=8123)
    args = ap.parse_args()
    from tokenmill.bench.machine import describe_machine

    print(describe_machine())
    env = dict(os.environ)
    rows = []
    if args.cold:
        with tempfile.TemporaryDirectory() as tmp:
            cold = env | {"TOKENMILL_CACHE_DIR": os.path.join(tmp, "tm"),
                          "TORCH_EXTENSIONS_DIR": os.path.join(tmp, "ext")}
            rows.append(("LLM() ready, empty caches", [time_llm(args.model, cold)]))
        with tempfile.TemporaryDirectory() as tmp:
            cold = env | {"TOKENMILL_CACHE_DIR": os.path.join(tmp, "tm"),
                          "TORCH_EXTENSIONS_DIR": os.path.join(tmp, "ext")}
            rows.append(("serve /health, empty caches",
                         [time_serve(args.model, args.port, cold)]))
    time_llm(args.model, env)  # make sure the caches are filled
    rows.append(("LLM() ready", [time_llm(args.model, env) for _ in range(args.repeats)]))
    rows.append(("serve /health 200", [time_serve(args.model, args.port, env)
                                       for _ in range(args.repeats)]))
    print(f"\n{'start-up':<28}{'median s':>10}{'min s':>8}{'max s':>8}  runs")
    for name, times in rows:
        print(f"{name:<28}{statistics.median(times):>10.2f}{min(times):>8.2f}{max(times):>8.2f}"
              f"  {len(times)}")


if __name__ == "__main__":
    main()
