"""Single-stream decode through each way the engine can run a small decode step, interleaved
in one process on one model, so that the machine's drift hits every way alike.

    python benchmarks/decode_paths.py [--rounds 6] [--tokens 64] [--model M]

--model: a model path, or a shape name of tokenmill/bench/shapes.py (random weights of a real
shape, e.g. qwen3-0.6b).

Ways (models/cpu_decode.py):
- modules: every layer through its nn.Module forward (the path of any other step);
- fused:   all layers in one C++ call (csrc/decode_layers_cpu.cpp), the default.
--quantization runs both on quantized weights (the same method objects in both ways).
Each round runs, for every way in turn, one request (the `single-stream` prompt, 128 tokens)
for --tokens greedy tokens and records its inter-token latencies. Prints the median ITL and
decode tokens/s of each way over all rounds, and its speed relative to `modules`.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tokenmill import LLM, SamplingParams  # noqa: E402
from tokenmill.bench.machine import describe_machine  # noqa: E402
from tokenmill.bench.shapes import SHAPES, write_model_folder  # noqa: E402
from tokenmill.bench.workloads import load_workload  # noqa: E402
from tokenmill.model_loader.default_model import default_model_path  # noqa: E402

WAYS = {"modules": False, "fused": True}


def itls(llm: LLM, prompt: list[int], tokens: int) -> list[float]:
    engine = llm.engine
    engine.add_request(f"r{time.monotonic_ns()}", prompt,
                       SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True))
    times = []
    while engine.has_unfinished_requests():
        engine.step()
        times.append(time.perf_counter())
    return [b - a for a, b in zip(times[1:], times[2:], strict=False)]  # decode steps only


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--quantization", default=None)
    args = ap.parse_args()
    model, extra = args.model or default_model_path(), {}
    if model in SHAPES:
        model = str(write_model_folder(model, Path(tempfile.mkdtemp())))
        extra = {"load_format": "dummy"}
    (req,) = load_workload(model, "single-stream", 0)
    llm = LLM(model, quantization=args.quantization, **extra)
    decode = llm.engine.runner.model.model.fused_layers
    print(describe_machine())
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; {args.rounds} rounds "
          f"of {args.tokens} tokens per way")
    gaps: dict[str, list[float]] = {w: [] for w in WAYS}
    itls(llm, req.prompt_token_ids, 8)  # warm-up
    for _ in range(args.rounds):
        for way, enabled in WAYS.items():
            decode.enabled = enabled
            gaps[way] += itls(llm, req.prompt_token_ids, args.tokens)
    decode.enabled = True
    base = statistics.median(gaps["modules"])
    print(f"{'way':<10}{'ITL p50 ms':>12}{'tok/s':>8}{'vs modules':>12}")
    for way, g in gaps.items():
        med = statistics.median(g)
        print(f"{way:<10}{med * 1e3:>12.2f}{1 / med:>8.1f}{base / med:>11.2f}x")


if __name__ == "__main__":
    main()
