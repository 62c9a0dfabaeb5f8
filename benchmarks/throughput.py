"""Offline throughput: tokenmill against Hugging Face transformers in the same run.

    python benchmarks/throughput.py [--workload mixed] [--hf-batch-size 16] [--skip-hf]

tokenmill gets every request at once (continuous batching). Hugging Face `generate` runs
static batches of --hf-batch-size requests in order, left-padded, each batch generating until its
longest request is done (min_new_tokens = max_new_tokens, the equivalent of ignore_eos). Only the
requested tokens count as useful for both. Prints requests/s, output tokens/s and total
(prompt + output) tokens/s, and the ratio tokenmill / HF.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
from tqdm.auto import tqdm

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tokenmill import LLM, SamplingParams  # noqa: E402
from tokenmill.bench.workloads import BenchRequest, make_workload  # noqa: E402
from tokenmill.model_loader.default_model import default_model_path  # noqa: E402


def run_tokenmill(model: str, reqs: list[BenchRequest], options: dict) -> float:
    llm = LLM(model, **options)
    params = [SamplingParams(temperature=0, max_tokens=r.output_len, ignore_eos=True)
              for r in reqs]
    start = time.perf_counter()
    outs = llm.generate([r.prompt_token_ids for r in reqs], params)
    elapsed = time.perf_counter() - start
    got = sum(len(o.outputs[0].token_ids) for o in outs)
    assert got == sum(r.output_len for r in reqs), "tokenmill produced the wrong token count"
    return elapsed


@torch.inference_mode()
def run_hf(model_path: str, reqs: list[BenchRequest], batch_size: int) -> float:
    from transformers import AutoModelForCausalLM

    folder, name = os.path.split(model_path)
    kw = {"gguf_file": name} if name.endswith(".gguf") else {}
    model = AutoModelForCausalLM.from_pretrained(folder if kw else model_path,
                                                 dtype=torch.float32, **kw).eval()
    pad = 0
    start = time.perf_counter()
    for i in tqdm(range(0, len(reqs), batch_size), desc="HF static batches"):
        batch = reqs[i:i + batch_size]
        width = max(len(r.prompt_token_ids) for r in batch)
        ids = torch.full((len(batch), width), pad, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for j, r in enumerate(batch):  # left padding
            ids[j, width - len(r.prompt_token_ids):] = torch.tensor(r.prompt_token_ids)
            mask[j, width - len(r.prompt_token_ids):] = 1
        new = max(r.output_len for r in batch)
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new,
                       min_new_tokens=new, do_sample=False, pad_token_id=pad)
    return time.perf_counter() - start


def rates(reqs: list[BenchRequest], seconds: float) -> dict[str, float]:
    out_tokens = sum(r.output_len for r in reqs)
    total = out_tokens + sum(len(r.prompt_token_ids) for r in reqs)
    return {"seconds": seconds, "requests_per_s": len(reqs) / seconds,
            "output_tokens_per_s": out_tokens / seconds, "total_tokens_per_s": total / seconds}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct GGUF")
    ap.add_argument("--workload", default="mixed", choices=["mixed", "uniform"])
    ap.add_argument("--num-requests", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--hf-batch-size", type=int, default=16)
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--max-num-batched-tokens", type=int, default=None)
    ap.add_argument("--max-num-seqs", type=int, default=None)
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args()

    model = args.model or default_model_path()
    tok_llm_opts = {k: v for k, v in {"max_num_batched_tokens": args.max_num_batched_tokens,
                                      "max_num_seqs": args.max_num_seqs}.items() if v}
    from tokenmill.config import ModelConfig
    from tokenmill.engine.tokenizer import load_tokenizer

    mc = ModelConfig.from_path(model)
    special = set(load_tokenizer(mc).all_special_ids)
    reqs = make_workload(args.workload, mc.vocab_size, special, args.seed, args.num_requests)
    print(f"workload {args.workload}: {len(reqs)} requests, "
          f"{sum(len(r.prompt_token_ids) for r in reqs)} prompt + "
          f"{sum(r.output_len for r in reqs)} output tokens; torch threads "
          f"{torch.get_num_threads()}")

    results = {"tokenmill": rates(reqs, run_tokenmill(model, reqs, tok_llm_opts))}
    if not args.skip_hf:
        results[f"hf_static_bs{args.hf_batch_size}"] = rates(
            reqs, run_hf(model, reqs, args.hf_batch_size))

    print(f"\n{'engine':<20}{'time s':>10}{'req/s':>10}{'out tok/s':>12}{'total tok/s':>13}")
    for name, r in results.items():
        print(f"{name:<20}{r['seconds']:>10.1f}{r['requests_per_s']:>10.3f}"
              f"{r['output_tokens_per_s']:>12.1f}{r['total_tokens_per_s']:>13.1f}")
    if len(results) == 2:
        hf = results[f"hf_static_bs{args.hf_batch_size}"]
        ratio = results["tokenmill"]["total_tokens_per_s"] / hf["total_tokens_per_s"]
        results["ratio_tokenmill_over_hf"] = ratio
        print(f"\ntokenmill / HF (same requests, same machine): {ratio:.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"workload": args.workload, "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
