"""What a CPU step pays to fault its activations in: the same prefill with glibc's defaults
(`TOKENMILL_KEEP_HEAP=0`) and with freed memory kept for the next step (utils/heap.py), each in
a child process of its own, alternated over rounds.

Each child loads the model, warms it with two short prompts, then runs `--runs` batches of
`--batch` new prompts of `--prompt-len` tokens (one token each: the batch is one prefill
step), on the main thread or (`--thread`) on a thread started after the engine, as the
server's engine thread is. Per batch: wall seconds, minor page faults and the process's system
CPU seconds (the kernel zeroing and mapping pages) over the batch; the child's peak RSS.

    python benchmarks/step_memory.py [--model FILE] [--batch 16] [--prompt-len 128]
                                     [--rounds 3] [--thread]

The default model is real_gguf.py's Llama-3.2-1B Q4_K_M file where it has been made, else
the default SmolLM2 file.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import threading
import time

from tokenmill.bench.child import print_result, run_child
from tokenmill.bench.machine import describe_machine, process_memory_mib


def _default_model() -> str:
    from tokenmill.model_loader.default_model import default_model_path
    from tokenmill.model_loader.gguf_cache import cache_root

    made = cache_root() / "bench" / "llama-1b-Q4_K_M.gguf"
    return str(made) if made.exists() else default_model_path()


def _child(args: argparse.Namespace) -> dict:
    from tokenmill import LLM, SamplingParams

    llm = LLM(args.model, max_model_len=args.prompt_len + 16,
              max_num_batched_tokens=args.batch * args.prompt_len)
    vocab = min(llm.engine.config.model.vocab_size, 32000) - 100
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)

    def prompts(seed: int, n: int) -> list[list[int]]:  # distinct per batch: no prefix hits
        return [[(seed * 7919 + i * 131 + j * 17) % vocab + 100 for j in range(args.prompt_len)]
                for i in range(n)]

    runs: list[dict] = []

    def measure() -> None:
        llm.generate(prompts(0, 2), params, use_tqdm=False)
        for r in range(args.runs):
            before, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
            llm.generate(prompts(r + 1, args.batch), params, use_tqdm=False)
            wall, after = time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_SELF)
            runs.append({"wall_s": wall, "faults": after.ru_minflt - before.ru_minflt,
                         "sys_s": after.ru_stime - before.ru_stime})

    if args.thread:
        thread = threading.Thread(target=measure)
        thread.start()
        thread.join()
    else:
        measure()
    return {"runs": runs, "peak_rss_gib": process_memory_mib("VmHWM") / 1024}


def _run_child(keep: str, args: argparse.Namespace) -> dict:
    cmd = [sys.executable, "-m", "tokenmill.bench.step_memory", "--child", "--model", args.model,
           "--batch", str(args.batch), "--prompt-len", str(args.prompt_len),
           "--runs", str(args.runs)] + (["--thread"] if args.thread else [])
    return run_child(cmd, env={**os.environ, "TOKENMILL_KEEP_HEAP": keep})


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--runs", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--thread", action="store_true")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.model = args.model or _default_model()
    if args.child:
        print_result(_child(args))
        return 0
    print(describe_machine())
    print(f"{args.model}: {args.batch} x {args.prompt_len} prompt tokens a batch, "
          f"{'an engine thread' if args.thread else 'the main thread'}")
    labels = {"0": "glibc defaults", "1": "kept (default)"}
    runs: dict[str, list[dict]] = {k: [] for k in labels}
    peaks: dict[str, list[float]] = {k: [] for k in labels}
    print(f"{'round':>5} {'heap':16} {'tok/s per batch':>22} {'faults per batch':>22} "
          f"{'sys s':>12} {'peak RSS':>9}")
    for rnd in range(args.rounds):
        for keep, label in labels.items():
            r = _run_child(keep, args)
            runs[keep] += r["runs"]
            peaks[keep].append(r["peak_rss_gib"])
            tps = " / ".join(f"{args.batch * args.prompt_len / x['wall_s']:.1f}" for x in r["runs"])
            faults = " / ".join(str(x["faults"]) for x in r["runs"])
            sys_s = " / ".join(f"{x['sys_s']:.2f}" for x in r["runs"])
            print(f"{rnd + 1:>5} {label:16} {tps:>22} {faults:>22} {sys_s:>12} "
                  f"{r['peak_rss_gib']:7.2f} G", flush=True)
    print("medians over every batch:")
    for keep, label in labels.items():
        med = {k: statistics.median(x[k] for x in runs[keep]) for k in runs[keep][0]}
        print(f"  {label:16} {args.batch * args.prompt_len / med['wall_s']:7.1f} tok/s  "
              f"{med['faults']:9.0f} faults  {med['sys_s']:5.2f} s sys  "
              f"peak RSS {max(peaks[keep]):.2f} GiB")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
