"""Prefix caching on vs off, in the same run, on the standard workloads of shared/README.md:

- shared-prefix: one 1024-token system prompt + a distinct 64-token suffix for each of 64
  requests, 32 output tokens each, all submitted at once;
- multi-turn: 16 conversations x 4 turns; each turn resends the whole history (earlier prompts
  and answers) plus 64 new tokens and generates 64; a turn starts when the previous one ended.

Prints prefill tokens computed, mean time to first token, total time and prefix-cache hit rate,
and the on/off ratios.

    python benchmarks/prefix_cache.py [--model PATH] [--workload shared-prefix|multi-turn|both]
"""

from __future__ import annotations

import argparse
import random
import time

from tokenmill import LLM, SamplingParams
from tokenmill.bench import batch
from tokenmill.config_model import model_config
from tokenmill.engine.tokenizer import load_tokenizer


def run_batch(llm: LLM, prompts: list[list[int]], max_tokens: int
              ) -> tuple[list[list[int]], list[float]]:
    """Submit all at once; return outputs and each request's time to first token."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return batch.run_batch(llm.engine, prompts, params)


def shared_prefix(llm: LLM, draw) -> list[float]:
    system = draw(1024)
    prompts = [system + draw(64) for _ in range(64)]
    return run_batch(llm, prompts, 32)[1]


def multi_turn(llm: LLM, draw) -> list[float]:
    histories = [[] for _ in range(16)]
    ttfts = []
    for _ in range(4):
        prompts = [h + draw(64) for h in histories]
        outs, t = run_batch(llm, prompts, 64)
        histories = [p + o for p, o in zip(prompts, outs, strict=True)]
        ttfts += t
    return ttfts


def measure(model: str | None, workload: str, cache: bool, seed: int) -> dict[str, float]:
    mc = model_config(model)
    special = set(load_tokenizer(mc).all_special_ids)
    rng = random.Random(seed)
    allowed = [t for t in range(mc.vocab_size) if t not in special]
    draw = lambda n: [rng.choice(allowed) for _ in range(n)]
    llm = LLM(model, enable_prefix_caching=cache)
    start = time.perf_counter()
    ttfts = (shared_prefix if workload == "shared-prefix" else multi_turn)(llm, draw)
    total = time.perf_counter() - start
    s = llm.engine.stats()
    return {"prefill": s.num_prompt_tokens_computed, "prompt": s.prefix_cache_queries,
            "ttft": sum(ttfts) / len(ttfts), "total": total, "hit_rate": s.prefix_cache_hit_rate}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--workload", default="both",
                    choices=["shared-prefix", "multi-turn", "both"])
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    workloads = ["shared-prefix", "multi-turn"] if args.workload == "both" else [args.workload]
    for w in workloads:
        on = measure(args.model, w, True, args.seed)
        off = measure(args.model, w, False, args.seed)
        print(f"\n{w}: {on['prompt']} prompt tokens")
        print(f"{'cache':<6}{'prefill computed':>18}{'mean TTFT s':>13}{'total s':>10}"
              f"{'hit rate':>10}")
        for name, r in (("on", on), ("off", off)):
            print(f"{name:<6}{r['prefill']:>18}{r['ttft']:>13.2f}{r['total']:>10.1f}"
                  f"{r['hit_rate']:>10.1%}")
        print(f"off/on: prefill {off['prefill'] / on['prefill']:.1f}x, "
              f"mean TTFT {off['ttft'] / on['ttft']:.1f}x, total {off['total'] / on['total']:.1f}x")


if __name__ == "__main__":
    main()
