"""Offline throughput as vLLM's `benchmark_throughput` reports it: output and total tokens/s,
with TTFT and ITL percentiles, and an optional Hugging Face static-batching reference on the
same requests in the same run.

    python benchmarks/offline_throughput.py --model llama-8b --device cuda --dtype bfloat16 \
        [--workload sharegpt|uniform] [--num-requests N] [--hf-reference] [--json out.json] \
        [any engine flag: --max-num-seqs, --gpu-memory-utilization, --enforce-eager, ...]

--model: a shape name of tokenmill/bench/shapes.py (smollm2, llama-1b, llama-8b, tiny: random
weights of the real shape, load_format="dummy"; nothing is downloaded) or any model tokenmill
serves (a folder, GGUF file or Hub id). Workloads (tokenmill/bench/workloads.py, seeded, no
dataset download): `sharegpt` (default; 1,000 requests, prompts 4-1,024 and outputs 4-512
tokens, long-tailed as vLLM's ShareGPT set) and `uniform` (64 x 256 prompt + 128 output).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import tempfile
from pathlib import Path

import torch

from tokenmill.bench.machine import describe_machine
from tokenmill.bench.offline import OfflineResult, run_engine, run_hf_static
from tokenmill.bench.shapes import SHAPES, write_model_folder
from tokenmill.bench.workloads import BenchRequest, make_workload
from tokenmill.config import ModelConfig
from tokenmill.engine_args import EngineArgs


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workload", default="sharegpt", choices=["sharegpt", "uniform"])
    p.add_argument("--num-requests", type=int, default=None)
    p.add_argument("--workload-seed", type=int, default=0)
    p.add_argument("--hf-reference", action="store_true",
                   help="also run Hugging Face generate() in static batches on the same "
                        "requests (its eager attention, the model's dtype)")
    p.add_argument("--hf-batch-size", type=int, default=64)
    p.add_argument("--json", default=None)
    EngineArgs.add_cli_args(p)
    return p.parse_args()


def hf_model(mc: ModelConfig, dtype: str, device: str) -> torch.nn.Module:
    """The same model in transformers: random weights for dummy weights (speed does not
    depend on them), else the checkpoint's (a GGUF file through transformers' GGUF loader)."""
    from transformers import AutoModelForCausalLM

    torch_dtype = getattr(torch, dtype)
    if mc.load_format == "dummy":
        # built on the device: an 8B model's random init on the host takes minutes
        with torch.device(device):
            built = AutoModelForCausalLM.from_config(mc.hf_config, dtype=torch_dtype)
    elif mc.gguf_file is not None:
        folder, name = os.path.split(mc.gguf_file)
        built = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch_dtype)
    else:
        built = AutoModelForCausalLM.from_pretrained(mc.path, dtype=torch_dtype)
    return built.to(device).eval()


def report(name: str, r: OfflineResult) -> dict[str, float]:
    s = r.summary()
    print(f"{name:<26}{s['seconds']:>9.1f}{s['output_tokens_per_s']:>12.1f}"
          f"{s['total_tokens_per_s']:>13.1f}{s['ttft_p50_ms']:>10.1f}{s['ttft_p99_ms']:>10.1f}"
          f"{s['itl_p50_ms']:>9.2f}{s['itl_p99_ms']:>9.2f}", flush=True)
    return s


def main() -> None:
    args = parse_args()
    from tokenmill import LLM

    options = EngineArgs.cli_options(args)
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model
        if model in SHAPES:
            model = str(write_model_folder(model, Path(tmp)))
            options |= {"load_format": "dummy"}
        llm = LLM(model, **options)
        config = llm.engine.config
        special = set(llm.get_tokenizer().all_special_ids)
        reqs = make_workload(args.workload, config.model.vocab_size, special,
                             args.workload_seed, args.num_requests)
        device = config.device
        gpu = torch.cuda.get_device_name() if device.startswith("cuda") else "none"
        dtype = str(config.model.dtype).removeprefix("torch.")
        print(describe_machine())
        name = args.model or os.path.basename(config.model.gguf_file or config.model.path)
        print(f"GPU: {gpu}; model {name} ({dtype}); workload {args.workload}: "
              f"{len(reqs)} requests, {_tokens(reqs, True)} prompt + {_tokens(reqs, False)} "
              "output tokens\n")
        print(f"{'engine':<26}{'time s':>9}{'out tok/s':>12}{'total tok/s':>13}"
              f"{'TTFT p50':>10}{'TTFT p99':>10}{'ITL p50':>9}{'ITL p99':>9}  (ms)")
        run_engine(llm.engine, reqs[:8], tag="warmup")  # compiles kernels, warms caches
        llm.reset_prefix_cache()  # the measured requests find none of the warm-up's blocks
        results = {"tokenmill": report("tokenmill", run_engine(llm.engine, reqs))}
        if args.hf_reference:
            # tokenmill's memory (its KV cache fills the GPU's share) is given back first
            llm.engine.shutdown()
            del llm
            gc.collect()
            if device.startswith("cuda"):
                torch.cuda.empty_cache()
            hf = hf_model(config.model, dtype, device)
            label = f"hf static bs{args.hf_batch_size}"
            results[label] = report(label, run_hf_static(hf, reqs, args.hf_batch_size))
            ratio = (results["tokenmill"]["output_tokens_per_s"]
                     / results[label]["output_tokens_per_s"])
            print(f"\ntokenmill / HF static (same requests, same run): {ratio:.2f}x output tok/s")
    if args.json:
        Path(args.json).write_text(json.dumps(
            dict(machine=describe_machine(), gpu=gpu, model=name, dtype=dtype,
                 workload=args.workload, num_requests=len(reqs), results=results), indent=2))


def _tokens(reqs: list[BenchRequest], prompt: bool) -> int:
    return sum(len(r.prompt_token_ids) if prompt else r.output_len for r in reqs)


if __name__ == "__main__":
    main()
