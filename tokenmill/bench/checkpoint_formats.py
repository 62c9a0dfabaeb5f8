"""One model in the forms users bring, side by side in one run: the standard workloads
(`uniform`, `mixed`, `shared-prefix` total tokens/s; `single-stream` decode tokens/s) for each
`--formats` entry, and vLLM's CPU build on the same folder where it is installed (an optional
peer, as llama-cpp-python is).

Formats: `auto` (the checkpoint as tokenmill serves it by default: a bf16 / fp16 folder keeps
its half-precision weights), `float32` (dtype=float32: the weights widened at load), or a
file path (a GGUF file of the same model, served by default in its own blocks), optionally
`PATH@int8` (or `auto@int8`: the folder) for another weight format, `@kv=bfloat16` (any
`kv_cache_dtype`) for another KV cache format, e.g. `auto@kv=bfloat16`, and `@matmul=float32`
(any `matmul_dtype`) for a bf16 checkpoint's products in float32, `@block=64` for another KV
`block_size`, `@dtype=bfloat16` for another `dtype` (a float32 folder served in bf16). Each
runs in a child process of its own. vLLM runs under `--vllm-python` (default: this
interpreter), so it can live in a venv of its own (this checkout is put on its PYTHONPATH for
the shared workloads).
vLLM's single-stream figure is its decode rate after the first token, as tokenmill's is: the
time of a 1-token run of the same prompt is taken off the full run's.

Each workload runs `--rounds` times in the same engine (default 2) and the table shows the
median of the rounds after the first; the first round's figures are printed beneath. The
first round pays one-time costs the later ones do not: the KV cache's pages touched for the
first time (tokenmill maps its cache lazily; on a fresh VM the first touch of memory ran at
0.24 GB/s here, 60x slower than a second), the allocator's first growth. vLLM pays those at
start-up (it zeroes its KV space and runs warm-up steps before serving), inside its start
time; so a single cold round compares tokenmill's first requests with vLLM's warm ones.

    python benchmarks/checkpoint_formats.py FOLDER --formats auto,float32,model.Q4_1.gguf
        [--workloads uniform,mixed] [--rounds 2] [--vllm-python PYTHON | --no-vllm]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import time
from typing import Any

import tokenmill
from tokenmill.bench.child import ChildFailed, print_result, run_child
from tokenmill.bench.machine import describe_machine
from tokenmill.bench.workloads import load_workload

WORKLOADS = ("uniform", "mixed", "shared-prefix", "single-stream")


def write_bf16_folder(gguf_path: str, out: str) -> str:
    """A GGUF model written as a Hugging Face folder in bfloat16 (its float32 expansion rounded
    to bf16, as a bf16 checkpoint of it would hold), with its config, tokenizer and chat
    template: the form vLLM-CPU and the bf16 paths take. Returns `out`."""
    from pathlib import Path

    import torch
    import transformers

    from tokenmill.model_loader.gguf_convert import converted_folder, converted_weights

    folder = converted_weights(converted_folder(gguf_path), gguf_path)
    if folder is None:
        raise RuntimeError(f"{gguf_path}: no float32 expansion cached to write from")
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    model.to(torch.bfloat16).save_pretrained(out)
    for f in Path(folder).iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            shutil.copy(f, Path(out) / f.name)
    return out


def _engine_args(folder: str, fmt: str) -> tuple[str, dict]:
    """FORMAT[@QUANTIZATION][@kv=KV_CACHE_DTYPE][@matmul=MATMUL_DTYPE][@block=BLOCK_SIZE]
    [@dtype=DTYPE] → (model, LLM options)."""
    path, *extras = fmt.split("@")
    options: dict = {}
    for extra in extras:
        key, _, value = extra.rpartition("=")
        name = {"": "quantization", "kv": "kv_cache_dtype", "matmul": "matmul_dtype",
                "block": "block_size", "dtype": "dtype"}[key]
        options[name] = int(value) if name == "block_size" else value
    if path == "auto":
        return folder, options
    if path == "float32":
        return folder, {"dtype": "float32", **options}
    return path, options


def _child(folder: str, fmt: str, workloads: list[str], rounds: int) -> dict:
    from tokenmill import LLM

    model, options = _engine_args(folder, fmt)
    start = time.perf_counter()
    llm = LLM(model, max_model_len=2048, **options)
    mc = llm.engine.config.model
    result = {"weights": str(mc.weight_dtype or mc.quantization or mc.dtype),
              "start_s": time.perf_counter() - start}
    for name in workloads:
        reqs = load_workload(folder, name)
        result[name] = [_tokenmill_round(llm, name, reqs) for _ in range(rounds)]
    return result


def _tokenmill_round(llm: Any, name: str, reqs: list) -> float:
    """One round of a workload from an empty prefix cache: total tokens/s (single-stream:
    decode tokens/s after the first token)."""
    from tokenmill import SamplingParams
    from tokenmill.bench.latency import run_tokenmill_once

    llm.reset_prefix_cache()
    if name == "single-stream":
        return run_tokenmill_once(llm, reqs[0].prompt_token_ids,
                                  reqs[0].output_len)["decode_tokens_per_s"]
    params = [SamplingParams(temperature=0, max_tokens=r.output_len, ignore_eos=True)
              for r in reqs]
    start = time.perf_counter()
    outs = llm.generate([r.prompt_token_ids for r in reqs], params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    return sum(len(o.prompt_token_ids) + len(o.outputs[0].token_ids) for o in outs) / elapsed


def _vllm(folder: str, workloads: list[str], rounds: int) -> dict | None:
    try:
        from vllm import LLM, SamplingParams
    except ImportError:
        return None
    start = time.perf_counter()
    # a fixed KV space: vLLM's CPU default reserves 92% of the machine's memory and refuses to
    # start when less is free (this benchmark's parent holds some)
    llm = LLM(folder, dtype="bfloat16", max_model_len=2048, kv_cache_memory_bytes=4 << 30)
    result = {"weights": "vllm bf16", "start_s": time.perf_counter() - start}

    def run(reqs: list, max_tokens: int | None = None) -> tuple[list, float]:
        prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in reqs]
        params = [SamplingParams(temperature=0, max_tokens=max_tokens or r.output_len,
                                 ignore_eos=True) for r in reqs]
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        return outs, time.perf_counter() - start

    def one_round(name: str, reqs: list) -> float:
        llm.reset_prefix_cache()
        if name == "single-stream":  # decode tokens/s after the first token, as tokenmill's
            _, first = run(reqs[:1], max_tokens=1)
            llm.reset_prefix_cache()
            _, full = run(reqs[:1])
            return (reqs[0].output_len - 1) / (full - first)
        outs, elapsed = run(reqs)
        return sum(len(o.prompt_token_ids) + len(o.outputs[0].token_ids)
                   for o in outs) / elapsed

    for name in workloads:
        reqs = load_workload(folder, name)
        result[name] = [one_round(name, reqs) for _ in range(rounds)]
    return result


def _vllm_env(python: str, env: dict[str, str]) -> dict[str, str]:
    """vLLM's CPU set-up as its docs ask, on as many cores as tokenmill uses: its worker's
    OpenMP threads bound to CPUs 0..n-1 (its automatic binding keeps one core of a 2-core
    machine for the scheduler process and computes on the other alone), and its venv's Intel
    OpenMP preloaded where installed (tcmalloc too, where the system has it)."""
    import glob

    import torch

    threads = torch.get_num_threads()
    env = {**env, "OMP_NUM_THREADS": env.get("OMP_NUM_THREADS", str(threads)),
           "VLLM_CPU_OMP_THREADS_BIND": env.get("VLLM_CPU_OMP_THREADS_BIND", f"0-{threads - 1}")}
    prefix = os.path.dirname(os.path.dirname(python))
    preload = [*glob.glob(os.path.join(prefix, "lib", "libiomp5.so")),
               *glob.glob("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so*")[:1]]
    if preload:
        env["LD_PRELOAD"] = ":".join([*preload, *env.get("LD_PRELOAD", "").split(":")]).strip(":")
    return env


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("folder", help="a Hugging Face folder (bf16 or fp16 checkpoint)")
    p.add_argument("--formats", default="auto,float32")
    p.add_argument("--workloads", default=",".join(WORKLOADS))
    p.add_argument("--vllm-python", default=sys.executable,
                   help="the Python of a venv with vLLM's CPU build (default: this one)")
    p.add_argument("--no-vllm", action="store_true", help="tokenmill's formats only")
    p.add_argument("--rounds", type=int, default=2,
                   help="rounds of each workload per engine; the table shows the median of "
                        "those after the first (1: the cold round alone)")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    workloads = args.workloads.split(",")
    if args.child is not None:
        if args.child == "vllm":
            result = _vllm(args.folder, workloads, args.rounds)
        else:
            result = _child(args.folder, args.child, workloads, args.rounds)
        print_result(result)
        return 0
    print(describe_machine())
    print(f"{'format':36s} {'weights':>16s} {'start s':>8s} "
          + " ".join(f"{w:>14s}" for w in workloads))
    repo = os.path.dirname(os.path.dirname(os.path.abspath(tokenmill.__file__)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        p for p in (repo, os.environ.get("PYTHONPATH")) if p)}
    for fmt in [*args.formats.split(","), *([] if args.no_vllm else ["vllm"])]:
        python = args.vllm_python if fmt == "vllm" else sys.executable
        if shutil.which(python) is None:
            print(f"{fmt}: no Python at {python}; skipped")
            continue
        try:
            r = run_child([python, "-m", "tokenmill.bench.checkpoint_formats", args.folder,
                           "--child", fmt, "--workloads", args.workloads,
                           "--rounds", str(args.rounds)],
                          env=_vllm_env(python, env) if fmt == "vllm" else env)
        except ChildFailed as e:
            print(f"{fmt}: failed\n{str(e)[-1500:]}")
            continue
        if r is None:
            print("vllm: not installed (an optional peer); skipped")
            continue
        print(f"{fmt[-36:]:36s} {r['weights']:>16s} {r['start_s']:8.1f} "
              + " ".join(f"{warm_rate(r[w]):14.1f}" for w in workloads))
        if args.rounds > 1:
            print(f"{'  (first round)':36s} {'':>16s} {'':>8s} "
                  + " ".join(f"{r[w][0]:14.1f}" for w in workloads))
    return 0


def warm_rate(rounds: list[float]) -> float:
    """The figure a format is compared by: the median of the rounds after the first (the
    only round when there is one)."""
    return statistics.median(rounds[1:] or rounds)


if __name__ == "__main__":
    raise SystemExit(main())
