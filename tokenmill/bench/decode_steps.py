"""Single decode steps of tokenmill and llama.cpp on one GGUF file, interleaved in one process.

Runs of either engine in its own process moved by 20-30% within minutes on the development
machines (benchmarks/RESULTS.md, fifty-first session), more than the margins being measured.
Here both engines hold the file at once and take turns (bench/alternate.py, as every CPU
comparison here): after the same prompt, each round runs a block of single decode steps of
one engine, then of the other (the engine's whole step for tokenmill: schedule, forward,
sample, outputs; llama.cpp's `eval` of one token, its forward and logits copy, no sampling),
the first step of each turn untimed (the other's threads may still be spinning down). The
medians over rounds of each block's mean step; the ratio is llama.cpp's over tokenmill's.

    python benchmarks/decode_steps.py MODEL.gguf [--prompt-len 32] [--steps 60] [--block 10]
        [--rounds 2]
"""

from __future__ import annotations

import argparse
import os

import numpy as np

from tokenmill.bench.alternate import alternate
from tokenmill.bench.machine import describe_machine


def run_round(llm, peer, prompt: list[int], steps: int, block: int,
              rng: np.random.Generator) -> tuple[float, float]:
    """Seconds a decode step of each engine after `prompt` (its prefill untimed)."""
    from tokenmill import SamplingParams

    engine = llm.engine
    rounds = max(1, steps // block)
    engine.add_request(f"steps-{len(prompt)}-{rng.integers(1 << 30)}", prompt,
                       SamplingParams(temperature=0, max_tokens=rounds * (block + 1) + 2,
                                      ignore_eos=True))
    while not any(o.outputs[0].token_ids for o in engine.step()):
        pass  # the prompt's chunks, untimed, until its first token
    peer.reset()
    peer.eval(prompt)
    times = alternate({"tokenmill": engine.step,
                       "llama.cpp": lambda: peer.eval([int(rng.integers(3, 32000))])},
                      rounds, block)
    while engine.has_unfinished_requests():
        engine.step()
    return times["tokenmill"], times["llama.cpp"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", help="a GGUF file both engines read")
    ap.add_argument("--prompt-len", type=int, nargs="+", default=[32])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--block", type=int, default=10, help="steps an engine runs per turn")
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    from llama_cpp import Llama

    from tokenmill import LLM

    context = max(args.prompt_len) + args.steps + args.steps // args.block + 16
    llm = LLM(args.model, max_model_len=context)
    peer = Llama(args.model, n_ctx=context, n_threads=os.cpu_count(), n_batch=512,
                 verbose=False)
    print(describe_machine())
    rng = np.random.default_rng(0)
    for length in args.prompt_len:
        for r in range(args.rounds):
            prompt = rng.integers(3, 32000, length).tolist()
            ours, theirs = run_round(llm, peer, prompt, args.steps, args.block, rng)
            print(f"prompt {length:>5}, round {r + 1}: tokenmill {ours * 1e3:7.2f} ms a step  "
                  f"llama.cpp {theirs * 1e3:7.2f} ms  (tokenmill {theirs / ours:.2f}x)",
                  flush=True)


if __name__ == "__main__":
    main()
