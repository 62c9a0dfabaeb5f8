"""Single decode steps of tokenmill and llama.cpp on one GGUF file, interleaved in one process.

Runs of either engine in its own process moved by 20-30% within minutes on the development
machines (benchmarks/RESULTS.md, fifty-first session), more than the margins being measured.
Here both engines hold the file at once and take turns (bench/alternate.py, as every CPU
comparison here): after the same prompt, each round runs a block of single decode steps of
one engine, then of the other (the engine's whole step for tokenmill: schedule, forward,
sample, outputs; llama.cpp's `eval` of one token, its forward and logits copy, no sampling),
the first step of each turn untimed (the other's threads may still be spinning down). The
medians over rounds of each block's mean step; the ratio is llama.cpp's over tokenmill's.

`--compare OLD_CSRC` adds a third turn: the same engine's steps with the kernels built from
another csrc folder (bench/kernel_builds.py), so a kernel change is shown before and after
in one process, beside llama.cpp. `--no-peer` leaves llama.cpp out; MODEL may then be any
model tokenmill serves (an HF folder too), and `--batch N` steps N sequences at once (each
its own prompt of the same length): a batched decode step, before and after a kernel change.

    python benchmarks/decode_steps.py MODEL.gguf [--prompt-len 32] [--steps 60] [--block 10]
        [--rounds 2] [--compare OLD_CSRC] [--no-peer [--batch N]]
"""

from __future__ import annotations

import argparse
import os

import numpy as np

from tokenmill.bench.alternate import alternate
from tokenmill.bench.kernel_builds import build_kernels, using_kernels
from tokenmill.bench.machine import describe_machine


def run_round(llm, peer, old_kernels: dict | None, prompts: list[list[int]], steps: int,
              block: int, rng: np.random.Generator) -> dict[str, float]:
    """Seconds a decode step of each engine (and of tokenmill with the old kernels) after
    `prompts` (tokenmill: all of them at once; llama.cpp: the one prompt; prefills
    untimed)."""
    from tokenmill import SamplingParams

    engine = llm.engine
    rounds = max(1, steps // block)
    turns = {"tokenmill": engine.step}
    if old_kernels is not None:
        def old_step() -> None:
            with using_kernels(old_kernels):
                engine.step()
        turns["tokenmill (old kernels)"] = old_step
    steps_taken = rounds * len(turns) * (block + 1)
    waiting = set()
    for prompt in prompts:
        request_id = f"steps-{len(prompt)}-{rng.integers(1 << 30)}"
        waiting.add(request_id)
        engine.add_request(request_id, prompt,
                           SamplingParams(temperature=0, max_tokens=steps_taken + 2,
                                          ignore_eos=True))
    while waiting:  # the prompts' chunks, untimed, until each has its first token
        waiting -= {o.request_id for o in engine.step() if o.outputs[0].token_ids}
    if peer is not None:
        peer.reset()
        peer.eval(prompts[0])
        turns["llama.cpp"] = lambda: peer.eval([int(rng.integers(3, 32000))])
    times = alternate(turns, rounds, block)
    while engine.has_unfinished_requests():
        engine.step()
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", help="a GGUF file both engines read")
    ap.add_argument("--prompt-len", type=int, nargs="+", default=[32])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--block", type=int, default=10, help="steps an engine runs per turn")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--compare", metavar="OLD_CSRC",
                    help="also step with the kernels of this csrc folder")
    ap.add_argument("--no-peer", action="store_true", help="leave llama.cpp out")
    ap.add_argument("--batch", type=int, default=1,
                    help="sequences tokenmill steps at once (above 1 needs --no-peer: "
                         "llama.cpp's turn decodes one sequence)")
    args = ap.parse_args()
    if args.batch > 1 and not args.no_peer:
        ap.error("--batch > 1 needs --no-peer: llama.cpp's turn decodes one sequence")
    from tokenmill import LLM

    old_kernels = build_kernels(args.compare) if args.compare else None
    # every turn's steps, and its first untimed step, extend the one sequence
    turns = 2 + (old_kernels is not None)
    context = max(args.prompt_len) + turns * (args.steps + args.steps // args.block) + 16
    llm = LLM(args.model, max_model_len=context)
    peer = None
    if not args.no_peer:
        from llama_cpp import Llama

        peer = Llama(args.model, n_ctx=context, n_threads=os.cpu_count(), n_batch=512,
                     verbose=False)
    print(describe_machine())
    rng = np.random.default_rng(0)
    for length in args.prompt_len:
        for r in range(args.rounds):
            prompts = [rng.integers(3, 32000, length).tolist() for _ in range(args.batch)]
            times = run_round(llm, peer, old_kernels, prompts, args.steps, args.block, rng)
            batch = f"batch {args.batch}, " if args.batch > 1 else ""
            print(f"{batch}prompt {length:>5}, round {r + 1}: " + describe(times), flush=True)


def describe(times: dict[str, float]) -> str:
    """Each turn's ms a step, and tokenmill's speed against the others'."""
    ours = times["tokenmill"]
    parts = [f"{name} {t * 1e3:7.2f} ms" for name, t in times.items()]
    ratios = [f"{t / ours:.2f}x {name}" for name, t in times.items() if name != "tokenmill"]
    return "  ".join(parts) + (f"  (tokenmill {', '.join(ratios)})" if ratios else "")


if __name__ == "__main__":
    main()
