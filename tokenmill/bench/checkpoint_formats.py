"""One model in the forms users bring, side by side in one run: the standard workloads
(`uniform`, `mixed`, `shared-prefix` total tokens/s; `single-stream` decode tokens/s) for each
`--formats` entry, and vLLM's CPU build on the same folder where it is installed (an optional
peer, as llama-cpp-python is).

Formats: `auto` (the checkpoint as tokenmill serves it by default: a bf16 / fp16 folder keeps
its half-precision weights), `float32` (dtype=float32: the weights widened at load), or a
file path (a GGUF file of the same model, served by default in its own blocks), optionally
`PATH@int8` for another weight format. Each runs in a child process of its own.

    python benchmarks/checkpoint_formats.py FOLDER --formats auto,float32,model.Q4_1.gguf
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

from tokenmill.bench.machine import describe_machine
from tokenmill.bench.workloads import load_workload

WORKLOADS = ("uniform", "mixed", "shared-prefix", "single-stream")


def _engine_args(folder: str, fmt: str) -> tuple[str, dict]:
    path, _, quant = fmt.partition("@")
    if path == "auto":
        return folder, {}
    if path == "float32":
        return folder, {"dtype": "float32"}
    return path, ({"quantization": quant} if quant else {})


def _child(folder: str, fmt: str, workloads: list[str]) -> dict:
    from tokenmill import LLM, SamplingParams
    from tokenmill.bench.latency import run_tokenmill_once

    model, options = _engine_args(folder, fmt)
    llm = LLM(model, max_model_len=2048, **options)
    mc = llm.engine.config.model
    result = {"weights": str(mc.weight_dtype or mc.quantization or mc.dtype)}
    for name in workloads:
        reqs = load_workload(folder, name)
        llm.reset_prefix_cache()
        if name == "single-stream":  # decode tokens/s after the first token
            run = run_tokenmill_once(llm, reqs[0].prompt_token_ids, reqs[0].output_len)
            result[name] = run["decode_tokens_per_s"]
            continue
        params = [SamplingParams(temperature=0, max_tokens=r.output_len, ignore_eos=True)
                  for r in reqs]
        start = time.perf_counter()
        outs = llm.generate([r.prompt_token_ids for r in reqs], params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        total = sum(len(o.prompt_token_ids) + len(o.outputs[0].token_ids) for o in outs)
        result[name] = total / elapsed
    return result


def _vllm(folder: str, workloads: list[str]) -> dict | None:
    try:
        from vllm import LLM, SamplingParams
    except ImportError:
        return None
    llm = LLM(folder, dtype="bfloat16", max_model_len=2048)
    result = {"weights": "vllm bf16"}
    for name in workloads:
        reqs = load_workload(folder, name)
        prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in reqs]
        params = [SamplingParams(temperature=0, max_tokens=r.output_len, ignore_eos=True)
                  for r in reqs]
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        if name == "single-stream":
            result[name] = reqs[0].output_len / elapsed
        else:
            result[name] = sum(len(o.prompt_token_ids) + len(o.outputs[0].token_ids)
                               for o in outs) / elapsed
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("folder", help="a Hugging Face folder (bf16 or fp16 checkpoint)")
    p.add_argument("--formats", default="auto,float32")
    p.add_argument("--workloads", default=",".join(WORKLOADS))
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    workloads = args.workloads.split(",")
    if args.child is not None:
        if args.child == "vllm":
            result = _vllm(args.folder, workloads)
        else:
            result = _child(args.folder, args.child, workloads)
        print("RESULT " + json.dumps(result))
        return 0
    print(describe_machine())
    print(f"{'format':36s} {'weights':>16s} " + " ".join(f"{w:>14s}" for w in workloads))
    for fmt in [*args.formats.split(","), "vllm"]:
        out = subprocess.run([sys.executable, "-m", "tokenmill.bench.checkpoint_formats",
                              args.folder, "--child", fmt, "--workloads", args.workloads],
                             capture_output=True, text=True)
        line = [x for x in out.stdout.splitlines() if x.startswith("RESULT ")]
        if out.returncode or not line:
            print(f"{fmt}: failed\n{out.stderr[-1500:]}")
            continue
        r = json.loads(line[0][7:])
        if r is None:
            print("vllm: not installed (an optional peer); skipped")
            continue
        print(f"{fmt[-36:]:36s} {r['weights']:>16s} "
              + " ".join(f"{r[w]:14.1f}" for w in workloads))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
