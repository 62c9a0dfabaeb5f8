"""KV tiers below the cache, in one run: 16 distinct 512-token prompts, then each again with a
new 32-token suffix (the repeat pass), against a KV budget that holds about one prompt. The
repeat pass is timed three ways:

- none: the prefix cache alone (it lost the prefixes: they are computed again);
- cpu: `--kv-offloading-size` (native): evicted blocks were copied to host memory;
- disk: `--kv-offloading-backend disk`: the first pass ran in an engine that was shut down; a
  new engine on the same directory serves the repeat pass (a restart);
- bigger cache: no tier, a KV cache large enough for every prompt. On CPU host memory is the
  KV cache's own RAM, so this is what the CPU tier's memory would buy as cache instead.

Prints, per mode: the repeat pass's wall time, mean time to first token, prompt tokens computed,
tokens found per tier, and the speed-up over none. Outputs are compared token for token.

    python benchmarks/kv_tiers.py [--model PATH] [--prompts 16] [--prompt-len 512]
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time

from tokenmill import LLM, SamplingParams
from tokenmill.bench.batch import run_batch
from tokenmill.bench.machine import describe_machine

SUFFIX, OUTPUT = 32, 16


def workload(n: int, length: int, vocab: int, seed: int = 0
             ) -> tuple[list[list[int]], list[list[int]]]:
    rng = random.Random(seed)
    draw = lambda k: [rng.randrange(100, vocab - 100) for _ in range(k)]
    prompts = [draw(length) for _ in range(n)]
    return [p + draw(SUFFIX) for p in prompts], [p + draw(SUFFIX) for p in prompts]


def run_pass(llm: LLM, prompts: list[list[int]]) -> tuple[list[list[int]], float, float, int]:
    """All prompts at once: outputs, wall seconds, mean TTFT, prompt tokens computed."""
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=OUTPUT, ignore_eos=True)
    computed = engine.stats().num_prompt_tokens_computed
    start = time.perf_counter()
    outs, ttft = run_batch(engine, prompts, params)
    wall = time.perf_counter() - start
    return (outs, wall, sum(ttft) / len(ttft),
            engine.stats().num_prompt_tokens_computed - computed)


def hits(llm: LLM) -> str:
    offload = llm.engine.kv.offload
    if offload is None:
        return "-"
    return " ".join(f"{tier} {n}" for tier, n in sorted(offload.hit_tokens.items())) or "0"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct Q4_1")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--offloading-size", default="2GiB")
    args = ap.parse_args()
    print(describe_machine())
    block_size = 16
    # about one prompt (with its suffix and output) fits the KV cache
    blocks = (args.prompt_len + SUFFIX + OUTPUT) // block_size + 4
    common = dict(num_kv_blocks=blocks, block_size=block_size)
    probe = LLM(args.model, **common)
    first, repeat = workload(args.prompts, args.prompt_len, probe.engine.config.model.vocab_size)
    del probe
    print(f"{args.prompts} prompts of {args.prompt_len} tokens, repeated with a new "
          f"{SUFFIX}-token suffix, {OUTPUT} output tokens; KV cache {blocks - 1} blocks of "
          f"{block_size} ({(blocks - 1) * block_size} tokens)")
    rows = []
    with tempfile.TemporaryDirectory(prefix="tm-kv-tiers-") as directory:
        modes = {"none": {}, "cpu": {"kv_offloading_size": args.offloading_size},
                 "disk": {"kv_offloading_size": args.offloading_size,
                          "kv_offloading_backend": "disk", "kv_offloading_dir": directory}}
        modes["bigger cache"] = {"num_kv_blocks": blocks * (args.prompts + 1)}
        for mode, options in modes.items():
            llm = LLM(args.model, **(common | options))
            run_pass(llm, first)
            if mode == "disk":  # a restart: a new engine finds the blocks on disk
                llm.engine.shutdown()
                del llm
                llm = LLM(args.model, **(common | options))
            outs, wall, ttft, computed = run_pass(llm, repeat)
            rows.append((mode, outs, wall, ttft, computed, hits(llm)))
            llm.engine.shutdown()
            del llm
    base_outs, base_wall = rows[0][1], rows[0][2]
    print(f"{'mode':12} {'repeat pass s':>13} {'mean TTFT s':>11} {'prompt tok computed':>19} "
          f"{'speed-up':>8}  same tokens  tokens found per tier")
    for mode, outs, wall, ttft, computed, found in rows:
        print(f"{mode:12} {wall:13.2f} {ttft:11.2f} {computed:19d} {base_wall / wall:7.2f}x"
              f"  {str(outs == base_outs):11}  {found}")


if __name__ == "__main__":
    main()
