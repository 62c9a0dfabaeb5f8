"""KV cache formats on SmolLM2: how many tokens the same --kv-cache-memory holds in each, and
whether greedy chat answers stay the same with an int8 cache.

    python benchmarks/kv_cache.py [--kv-cache-memory 256MiB] [--max-tokens 64]

1. Capacity: the engine's KV blocks x block size for each kv_cache_dtype, from the real bytes
   per block (values and scales).
2. Agreement: 12 chat prompts, greedy, the model's weights as shipped (GGUF Q4_1 blocks), a
   float32 cache against an int8 one: how many answers are identical, and where the first
   differing token falls in the others.
The int8 cache is read by the PyTorch attention backend only, for now (the C++ and Triton
kernels do not read it yet), so its speed is not compared here.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tokenmill import LLM, SamplingParams  # noqa: E402
from tokenmill.bench.machine import describe_machine  # noqa: E402

PROMPTS = ["What is the capital of France?", "Explain how a hash table works.",
           "Give me three tips for learning a new language.", "How do I make a good cup of tea?",
           "What are the benefits of regular exercise?", "Why is the sky blue?",
           "Write a haiku about autumn.", "What is photosynthesis?",
           "How does a bicycle stay upright?", "Summarize the plot of Romeo and Juliet.",
           "What is the difference between a virus and a bacterium?",
           "Suggest a name for a friendly robot."]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kv-cache-memory", default="256MiB")
    ap.add_argument("--max-tokens", type=int, default=64)
    args = ap.parse_args()
    print(describe_machine())
    engines = {kv: LLM(kv_cache_dtype=kv, kv_cache_memory=args.kv_cache_memory)
               for kv in ("auto", "int8")}
    print(f"\nSmolLM2-135M-Instruct, --kv-cache-memory {args.kv_cache_memory}")
    print(f"{'kv_cache_dtype':<16}{'tokens held':>12}{'vs auto':>9}{'attention backend':>20}")
    base = None
    for kv, llm in engines.items():
        runner = llm.engine.runner
        tokens = (runner.num_kv_blocks - 1) * runner.block_size
        base = base or tokens
        print(f"{kv:<16}{tokens:>12}{tokens / base:>8.2f}x"
              f"{type(runner.backend).__name__:>20}")

    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    answers = {kv: [o.outputs[0].token_ids for o in llm.chat(
        [[{"role": "user", "content": p}] for p in PROMPTS], params, use_tqdm=False)]
        for kv, llm in engines.items()}
    same = sum(a == b for a, b in zip(answers["auto"], answers["int8"], strict=True))
    firsts = [next(i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y)
              for a, b in zip(answers["auto"], answers["int8"], strict=True) if a != b]
    print(f"\ngreedy chat answers ({args.max_tokens} tokens at most), float32 cache vs int8: "
          f"{same} of {len(PROMPTS)} identical"
          + (f"; the others first differ at tokens {sorted(firsts)}" if firsts else ""))


if __name__ == "__main__":
    main()
