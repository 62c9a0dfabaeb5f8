"""KV cache formats on SmolLM2 (weights as shipped, GGUF Q4_1): capacity, agreement and speed
of a float32 ("auto"), int8 and fp8 cache, all in one run.

    python benchmarks/kv_cache.py [--dtypes auto,int8,fp8] [--parts capacity,agreement,speed]

1. Capacity: tokens the same --kv-cache-memory holds in each format (the engine's blocks x
   block size, from the real bytes per block: values and scales).
2. Agreement: 12 chat prompts, greedy: how many answers of each quantized cache are identical
   to the float32 cache's, and where the first differing token falls in the others.
3. Speed, the standard workloads of shared/README.md (random prompts, ignore_eos):
   - under memory pressure: `uniform` (64 x 256 prompt + 128 output) with each budget of
     --pressure-memory, where a float32 cache holds 15 or 22 of the 64 sequences at full
     length (preemption by recompute), and `shared-prefix` (1024-token system prompt + 64
     distinct 64-token suffixes, 32 output tokens each, prefix caching on) with each of
     --prefix-pressure-memory: total time of each format and its ratio to float32, with the
     preemptions counted;
   - without pressure (--kv-cache-memory 2GiB holds all of `uniform`): decode tokens/s at
     batch 64, timed from the step where every request has its first token to the end.
Each format runs in its own engine, one after the other, in the same process: only the
ratios within one run compare (the machine is noisy); --rounds repeats the speed part, every
other round in reverse order.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tokenmill import LLM, SamplingParams  # noqa: E402
from tokenmill.bench.machine import describe_machine  # noqa: E402
from tokenmill.bench.workloads import load_workload  # noqa: E402

PROMPTS = ["What is the capital of France?", "Explain how a hash table works.",
           "Give me three tips for learning a new language.", "How do I make a good cup of tea?",
           "What are the benefits of regular exercise?", "Why is the sky blue?",
           "Write a haiku about autumn.", "What is photosynthesis?",
           "How does a bicycle stay upright?", "Summarize the plot of Romeo and Juliet.",
           "What is the difference between a virus and a bacterium?",
           "Suggest a name for a friendly robot."]


def capacity(dtypes: list[str], memory: str) -> None:
    print(f"\ncapacity, --kv-cache-memory {memory}")
    print(f"{'kv_cache_dtype':<16}{'tokens held':>12}{'vs auto':>9}{'attention backend':>20}")
    base = None
    for kv in dtypes:
        runner = LLM(kv_cache_dtype=kv, kv_cache_memory=memory).engine.runner
        tokens = (runner.num_kv_blocks - 1) * runner.block_size
        base = base or tokens
        print(f"{kv:<16}{tokens:>12}{tokens / base:>8.2f}x{type(runner.backend).__name__:>20}")


def agreement(dtypes: list[str], max_tokens: int) -> None:
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    chats = [[{"role": "user", "content": p}] for p in PROMPTS]
    answers = {kv: [o.outputs[0].token_ids for o in LLM(kv_cache_dtype=kv).chat(
        chats, params, use_tqdm=False)] for kv in dtypes}
    print(f"\ngreedy chat answers ({max_tokens} tokens at most) against the float32 cache's")
    for kv in dtypes[1:]:
        pairs = list(zip(answers["auto"], answers[kv], strict=True))
        firsts = [next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y),
                       min(len(a), len(b))) for a, b in pairs if a != b]
        print(f"  {kv:<9} {sum(a == b for a, b in pairs)} of {len(PROMPTS)} identical"
              + (f"; the others first differ at tokens {sorted(firsts)}" if firsts else ""))


def run_batch(llm: LLM, prompts: list[list[int]], output_len: int) -> dict[str, float]:
    """All requests at once: total seconds, and decode tokens/s once all have started."""
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    preempted = engine.scheduler.num_preemptions
    start = time.perf_counter()
    for i, p in enumerate(prompts):
        engine.add_request(f"r{time.monotonic_ns()}-{i}", p, params)
    started: set[str] = set()
    t_all = None
    decoded = 0
    while engine.has_unfinished_requests():
        outs = engine.step()
        if t_all is not None:
            decoded += len(outs)  # one token per running request per step (no speculation)
        started |= {o.request_id for o in outs if o.outputs[0].token_ids}
        if t_all is None and len(started) == len(prompts):
            t_all = time.perf_counter()
    end = time.perf_counter()
    return {"total": end - start, "decode_tps": decoded / (end - t_all) if decoded else 0.0,
            "preemptions": engine.scheduler.num_preemptions - preempted}


def speed(dtypes: list[str], args: argparse.Namespace, reverse: bool) -> None:
    """Each run's formats one after the other, in reverse order when `reverse` (drift in the
    machine's speed then favours no format across rounds)."""
    uniform = [r.prompt_token_ids for r in load_workload(None, "uniform")]
    draw = iter([r.prompt_token_ids for r in load_workload(None, "uniform", seed=1,
                                                           num_requests=80)])
    system = (next(draw) * 4)[:1024]
    shared = [system + next(draw)[:64] for _ in range(64)]
    runs = [("uniform, pressure", m, uniform, 128, False)
            for m in args.pressure_memory.split(",") if m]
    runs += [("shared-prefix, pressure", m, shared, 32, True)
             for m in args.prefix_pressure_memory.split(",") if m]
    if args.kv_cache_memory:
        runs.append(("uniform, no pressure", args.kv_cache_memory, uniform, 128, False))
    for name, memory, prompts, out_len, prefix in runs:
        print(f"\n{name} (--kv-cache-memory {memory}, prefix caching "
              f"{'on' if prefix else 'off'}):")
        print(f"{'kv_cache_dtype':<16}{'tokens held':>12}{'total s':>9}{'vs auto':>9}"
              f"{'preemptions':>13}{'decode tok/s (batch 64)':>25}")
        results = {}
        for kv in (dtypes[::-1] if reverse else dtypes):
            llm = LLM(kv_cache_dtype=kv, kv_cache_memory=memory, enable_prefix_caching=prefix)
            runner = llm.engine.runner
            results[kv] = (runner.num_kv_blocks - 1) * runner.block_size, run_batch(
                llm, prompts, out_len)
            del llm, runner
        base = results[dtypes[0]][1]["total"]
        for kv in dtypes:
            tokens, r = results[kv]
            print(f"{kv:<16}{tokens:>12}{r['total']:>9.1f}{base / r['total']:>8.2f}x"
                  f"{r['preemptions']:>13}{r['decode_tps']:>25.0f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtypes", default="auto,int8,fp8")
    ap.add_argument("--parts", default="capacity,agreement,speed")
    ap.add_argument("--kv-cache-memory", default="2GiB")
    ap.add_argument("--pressure-memory", default="256MiB,384MiB",
                    help="budgets for `uniform` under pressure (comma-separated)")
    ap.add_argument("--prefix-pressure-memory", default="80MiB,128MiB",
                    help="budgets for `shared-prefix` under pressure (comma-separated)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=1)
    args = ap.parse_args()
    dtypes = args.dtypes.split(",")
    parts = args.parts.split(",")
    print(describe_machine())
    if "capacity" in parts:
        capacity(dtypes, args.kv_cache_memory)
    if "agreement" in parts:
        agreement(dtypes, args.max_tokens)
    for i in range(args.rounds if "speed" in parts else 0):
        speed(dtypes, args, reverse=i % 2 == 1)


if __name__ == "__main__":
    main()
