"""What batch invariance costs: the invariant kernels (the default on CPU) against the kernels
before them (`batch_invariant=False`: oneDNN's prepacked GEMMs and the small-M row kernels
for dense weights, MKL on expanded tiles or the VNNI GEMMs for quantized ones, attention
split by the call's shape, cascades over shared prefixes, PyTorch SDPA for long prefill
chunks), in one run on one machine.

    python benchmarks/batch_invariance.py [--formats none,gguf] [--workloads uniform,mixed]
                                          [--model PATH] [--rounds 1]

For each weight format (default: float32, "none", and the GGUF file's own blocks, "gguf")
one engine per mode, all alive at once, taking turns: the `uniform` and `mixed` workloads
offline (all requests at once; total tokens/s), then `single-stream` (decode tokens/s, the
median inter-token gap). Prints each figure, the invariant / before ratio, and whether each
mode's greedy tokens for the workload's first request are the same alone and inside its
batch (they are under invariance; the kernels before may round them otherwise).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tokenmill import LLM, SamplingParams  # noqa: E402
from tokenmill.bench.machine import describe_machine  # noqa: E402
from tokenmill.bench.workloads import BenchRequest, load_workload  # noqa: E402
from tokenmill.model_loader.default_model import default_model_path  # noqa: E402

MODES = {"invariant": True, "before": False}


def offline(llm: LLM, requests: list[BenchRequest]) -> tuple[float, list[int]]:
    """(total tokens/s, the first request's tokens) with every request submitted at once."""
    params = [SamplingParams(temperature=0, max_tokens=r.output_len, ignore_eos=True)
              for r in requests]
    t0 = time.perf_counter()
    outs = llm.generate([r.prompt_token_ids for r in requests], params, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    total = sum(len(r.prompt_token_ids) + r.output_len for r in requests)
    return total / elapsed, list(outs[0].outputs[0].token_ids)


def alone(llm: LLM, request: BenchRequest) -> list[int]:
    params = SamplingParams(temperature=0, max_tokens=request.output_len, ignore_eos=True)
    llm.reset_prefix_cache()
    return list(llm.generate([request.prompt_token_ids], params,
                             use_tqdm=False)[0].outputs[0].token_ids)


def single_stream(llm: LLM, request: BenchRequest) -> float:
    """Decode tokens/s: 1 / the median gap between steps after the first token."""
    engine = llm.engine
    llm.reset_prefix_cache()
    engine.add_request(f"s{time.monotonic_ns()}", request.prompt_token_ids,
                       SamplingParams(temperature=0, max_tokens=request.output_len,
                                      ignore_eos=True))
    times = []
    while engine.has_unfinished_requests():
        engine.step()
        times.append(time.perf_counter())
    return 1 / statistics.median(b - a for a, b in zip(times[1:], times[2:], strict=False))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct (GGUF)")
    ap.add_argument("--formats", default="none,gguf")
    ap.add_argument("--workloads", default="uniform,mixed")
    ap.add_argument("--rounds", type=int, default=1)
    args = ap.parse_args()
    model = args.model or default_model_path()
    print(describe_machine())
    engines = {(fmt, mode): LLM(model, quantization=fmt, batch_invariant=inv)
               for fmt in args.formats.split(",") for mode, inv in MODES.items()}
    rows: dict[tuple[str, str, str], list[float]] = {}
    same: dict[tuple[str, str, str], bool] = {}
    for workload in args.workloads.split(","):
        requests = load_workload(model, workload, 0)
        for _ in range(args.rounds):
            for key, llm in engines.items():
                rate, first = offline(llm, requests)
                rows.setdefault((workload, *key), []).append(rate)
                same[(workload, *key)] = first == alone(llm, requests[0])
    (stream,) = load_workload(model, "single-stream", 0)
    for llm in engines.values():
        single_stream(llm, BenchRequest(stream.prompt_token_ids, 16))  # warm-up
    for _ in range(max(2, args.rounds)):
        for key, llm in engines.items():
            rows.setdefault(("single-stream", *key), []).append(single_stream(llm, stream))
    print(f"{'workload':<15}{'format':<8}{'invariant':>11}{'before':>10}{'ratio':>8}"
          f"   first request alone == in batch (invariant / before)")
    for workload in [*args.workloads.split(","), "single-stream"]:
        unit = "decode tok/s" if workload == "single-stream" else "total tok/s"
        for fmt in args.formats.split(","):
            inv = statistics.median(rows[(workload, fmt, "invariant")])
            old = statistics.median(rows[(workload, fmt, "before")])
            check = ("" if workload == "single-stream" else
                     f"   {same[(workload, fmt, 'invariant')]} / "
                     f"{same[(workload, fmt, 'before')]}")
            print(f"{workload:<15}{fmt:<8}{inv:>11.1f}{old:>10.1f}{inv / old:>7.2f}x{check}"
                  f"   ({unit})")


if __name__ == "__main__":
    main()
