"""`tokenmill bench throughput`: offline throughput on a standard workload, optionally against
Hugging Face transformers static batching in the same run.

tokenmill gets every request at once (continuous batching). Hugging Face `generate` runs static
batches of --hf-batch-size requests in order, left-padded, each batch generating until its
longest request is done (min_new_tokens = max_new_tokens, the equivalent of ignore_eos). Only
the requested tokens count for both. Reports requests/s, output tokens/s and total (prompt +
output) tokens/s, and the ratio tokenmill / HF.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

from tokenmill.bench.machine import describe_machine
from tokenmill.bench.offline import run_hf_static
from tokenmill.bench.weight_specs import weights_as
from tokenmill.bench.workloads import BenchRequest, load_workload
from tokenmill.engine_args import EngineArgs


def add_arguments(p: argparse.ArgumentParser) -> None:

    p.add_argument("--workload", default="mixed", choices=["mixed", "uniform", "sharegpt"])
    p.add_argument("--num-requests", type=int, default=None)
    p.add_argument("--workload-seed", type=int, default=0)
    p.add_argument("--compare-hf", action="store_true",
                   help="also run Hugging Face transformers static batching on the same requests")
    p.add_argument("--hf-batch-size", type=int, default=16)
    p.add_argument("--compare-quantization", default=None, metavar="M1,M2",
                   help="one tokenmill run per weight format, in this order, e.g. none,int8,"
                        "gguf+int8acts (tokenmill/bench/weight_specs.py)")
    p.add_argument("--json", default=None, help="write the results here")
    p.add_argument("--png", default=None, help="write a bar chart of total tokens/s here")
    EngineArgs.add_cli_args(p)


def run_tokenmill(model: str | None, reqs: list[BenchRequest], options: dict) -> float:
    from tokenmill import LLM, SamplingParams

    llm = LLM(model, **options)
    params = [SamplingParams(temperature=0, max_tokens=r.output_len, ignore_eos=True)
              for r in reqs]
    start = time.perf_counter()
    outs = llm.generate([r.prompt_token_ids for r in reqs], params)
    elapsed = time.perf_counter() - start
    got = sum(len(o.outputs[0].token_ids) for o in outs)
    if got != sum(r.output_len for r in reqs):
        raise RuntimeError("tokenmill produced the wrong number of tokens")
    return elapsed


@torch.inference_mode()
def run_hf(model_path: str, reqs: list[BenchRequest], batch_size: int) -> float:
    from transformers import AutoModelForCausalLM

    folder, name = os.path.split(model_path)
    kw = {"gguf_file": name} if name.endswith(".gguf") else {}
    model = AutoModelForCausalLM.from_pretrained(folder if kw else model_path,
                                                 dtype=torch.float32, **kw).eval()
    return run_hf_static(model, reqs, batch_size).seconds


def rates(reqs: list[BenchRequest], seconds: float) -> dict[str, float]:
    out_tokens = sum(r.output_len for r in reqs)
    total = out_tokens + sum(len(r.prompt_token_ids) for r in reqs)
    return {"seconds": seconds, "requests_per_s": len(reqs) / seconds,
            "output_tokens_per_s": out_tokens / seconds, "total_tokens_per_s": total / seconds}


def run(args: argparse.Namespace) -> int:
    from tokenmill.model_loader.default_model import default_model_path

    model = args.model or default_model_path()
    reqs = load_workload(model, args.workload, args.workload_seed, args.num_requests)
    print(f"workload {args.workload}: {len(reqs)} requests, "
          f"{sum(len(r.prompt_token_ids) for r in reqs)} prompt + "
          f"{sum(r.output_len for r in reqs)} output tokens")
    print(describe_machine())
    options = EngineArgs.cli_options(args)
    results = {}
    if args.compare_quantization:
        for spec in args.compare_quantization.split(","):  # weight_specs.py
            with weights_as(spec) as weights:
                seconds = run_tokenmill(model, reqs, options | weights)
            results[f"tokenmill {spec}"] = rates(reqs, seconds)
        first = next(iter(results.values()))["total_tokens_per_s"]
        for name, r in results.items():
            print(f"{name}: {r['total_tokens_per_s']:.1f} total tokens/s, "
                  f"{r['total_tokens_per_s'] / first:.2f}x the first")
    else:
        results["tokenmill"] = rates(reqs, run_tokenmill(model, reqs, options))
    hf_name = f"hf_static_bs{args.hf_batch_size}"
    if args.compare_hf:
        results[hf_name] = rates(reqs, run_hf(model, reqs, args.hf_batch_size))

    print(f"\n{'engine':<28}{'time s':>10}{'req/s':>10}{'out tok/s':>12}{'total tok/s':>13}")
    for name, r in results.items():
        print(f"{name:<28}{r['seconds']:>10.1f}{r['requests_per_s']:>10.3f}"
              f"{r['output_tokens_per_s']:>12.1f}{r['total_tokens_per_s']:>13.1f}")
    summary: dict = {"workload": args.workload, "results": results}
    if args.compare_hf and "tokenmill" in results:
        ratio = (results["tokenmill"]["total_tokens_per_s"]
                 / results[hf_name]["total_tokens_per_s"])
        summary["ratio_tokenmill_over_hf"] = ratio
        print(f"\ntokenmill / HF (same requests, same machine): {ratio:.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=2)
    if args.png:
        _plot(results, args.workload, args.png)
    return 0


def _plot(results: dict[str, dict[str, float]], workload: str, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results)
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.bar(names, [results[n]["total_tokens_per_s"] for n in names], color="tab:blue")
    ax.set_ylabel("total tokens/s (prompt + output)")
    ax.set_title(f"offline throughput, {workload} workload")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
