"""Priority scheduling under load, in one run: a Poisson stream of requests in three priority
classes (0: 10%, 1: 30%, 2: 60%; lower is served first) arriving faster than the engine
serves them, through `--scheduling-policy fcfs` and `priority` (engines alternating on the
same arrivals). Prints TTFT and end-to-end latency percentiles per class.

    python benchmarks/priority.py [--model PATH] [--requests 96] [--rate 12] [--max-num-seqs 16]
"""

from __future__ import annotations

import argparse
import random
import time

from tokenmill import LLM, SamplingParams
from tokenmill.bench.machine import describe_machine
from tokenmill.bench.serving import percentile as pct

CLASSES = ((0, 0.1), (1, 0.3), (2, 0.6))


def workload(n: int, rate: float, vocab: int, prompt_len: int, seed: int = 0):
    rng = random.Random(seed)
    t, out = 0.0, []
    for i in range(n):
        t += rng.expovariate(rate)
        prio = rng.choices([c for c, _ in CLASSES], [w for _, w in CLASSES])[0]
        out.append((t, f"r{i}", [rng.randrange(100, vocab - 100) for _ in range(prompt_len)],
                    prio))
    return out


def run(llm: LLM, arrivals, params: SamplingParams, use_priority: bool
        ) -> dict[str, tuple[int, float, float]]:
    """request id → (priority, TTFT, end-to-end latency), arrivals replayed in real time."""
    engine, pending = llm.engine, list(arrivals)
    sent: dict[str, tuple[int, float]] = {}
    first: dict[str, float] = {}
    done: dict[str, tuple[int, float, float]] = {}
    start = time.perf_counter()
    while pending or engine.has_unfinished_requests():
        now = time.perf_counter() - start
        while pending and pending[0][0] <= now:
            t, rid, prompt, prio = pending.pop(0)
            engine.add_request(rid, prompt, params, priority=prio if use_priority else 0)
            sent[rid] = (prio, time.perf_counter())
        if not engine.has_unfinished_requests():
            time.sleep(max(0.0, pending[0][0] - now))
            continue
        for out in engine.step():
            rid, t = out.request_id, time.perf_counter()
            if rid not in first and out.outputs[0].token_ids:
                first[rid] = t
            if out.finished:
                prio, t0 = sent[rid]
                done[rid] = (prio, first[rid] - t0, t - t0)
    return done


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct Q4_1")
    ap.add_argument("--requests", type=int, default=96)
    ap.add_argument("--rate", type=float, default=12.0, help="arrivals per second")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--max-num-seqs", type=int, default=16)
    args = ap.parse_args()
    print(describe_machine())
    engines = {policy: LLM(args.model, scheduling_policy=policy,
                           max_num_seqs=args.max_num_seqs) for policy in ("fcfs", "priority")}
    vocab = engines["fcfs"].engine.config.model.vocab_size
    arrivals = workload(args.requests, args.rate, vocab, args.prompt_len)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    run(engines["fcfs"], arrivals[:4], params, False)  # warm-up
    print(f"{args.requests} requests, Poisson {args.rate}/s, {args.prompt_len} + "
          f"{args.max_tokens} tokens, max_num_seqs {args.max_num_seqs}; classes "
          + ", ".join(f"{c}: {w:.0%}" for c, w in CLASSES))
    print(f"{'policy':9} {'class':>5} {'n':>3} {'TTFT p50':>9} {'p90':>6} {'p99':>6} "
          f"{'e2e p50':>8} {'p90':>6} {'p99':>6} (s)")
    for policy, llm in engines.items():
        done = run(llm, arrivals, params, policy == "priority")
        for c, _ in CLASSES:
            rows = [v for v in done.values() if v[0] == c]
            ttft, e2e = [r[1] for r in rows], [r[2] for r in rows]
            print(f"{policy:9} {c:5d} {len(rows):3d} {pct(ttft, 50):9.2f} {pct(ttft, 90):6.2f} "
                  f"{pct(ttft, 99):6.2f} {pct(e2e, 50):8.2f} {pct(e2e, 90):6.2f} "
                  f"{pct(e2e, 99):6.2f}")


if __name__ == "__main__":
    main()
