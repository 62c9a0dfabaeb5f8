"""`tokenmill bench latency`: the `single-stream` workload (one request, 128 prompt tokens, 256
output tokens): time to first token, decode tokens/s and inter-token latency percentiles.

Each repeat is one request through the offline engine, timed token by token as the engine
emits it (after --warmup untimed repeats). With --llama-cpp, the same prompt tokens run through
llama-cpp-python on the same GGUF file in the same process (an optional peer: skipped with a
note when the package is not installed); --llama-cpp-f32 also gives it an F32 copy of the file
(bench/gguf_f32.py), the float32 weights tokenmill itself computes with. The engines take
turns: each of --repeats rounds runs one request on every engine.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time

import torch

from tokenmill.bench.machine import describe_machine
from tokenmill.bench.weight_specs import weights_as
from tokenmill.bench.workloads import load_workload
from tokenmill.engine_args import EngineArgs


def add_arguments(p: argparse.ArgumentParser) -> None:

    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--workload-seed", type=int, default=0)
    p.add_argument("--llama-cpp", action="store_true",
                   help="also run llama-cpp-python (if installed) on the same GGUF file")
    p.add_argument("--llama-cpp-f32", action="store_true",
                   help="with --llama-cpp: run llama.cpp on an F32 copy of the GGUF file (the "
                        "float32 weights tokenmill uses) as well as on the file as it is")
    p.add_argument("--llama-cpp-threads", type=int, default=None)
    p.add_argument("--compare-quantization", default=None, metavar="M1,M2",
                   help="one tokenmill engine per weight format in the same run, e.g. "
                        "none,int8,gguf,gguf+int8acts (tokenmill/bench/weight_specs.py)")
    p.add_argument("--json", default=None, help="write the results here")
    p.add_argument("--png", default=None, help="plot inter-token latency by position here")
    EngineArgs.add_cli_args(p)


def _summarise(ttft: float, token_times: list[float], start: float) -> dict:
    """token_times: the wall clock at which each output token was available."""
    gaps = [b - a for a, b in zip(token_times, token_times[1:], strict=False)]
    decode_s = token_times[-1] - token_times[0]
    return {"ttft_s": ttft, "decode_tokens_per_s": len(gaps) / decode_s if decode_s else 0.0,
            "itl_ms": [g * 1e3 for g in gaps], "e2e_s": token_times[-1] - start}


def weight_bytes(model: torch.nn.Module) -> tuple[int, int]:
    """(bytes of the model's parameters, bytes of the oneDNN-packed copies beside them)."""
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    packed = sum(m.packed_weight.numel() * m.packed_weight.element_size()
                 for m in model.modules() if getattr(m, "packed_weight", None) is not None)
    return params, packed


def run_tokenmill_once(llm, prompt: list[int], output_len: int) -> dict:
    from tokenmill import SamplingParams

    engine = llm.engine
    # Every run prefills its prompt from scratch, as llama.cpp's reset=True does: the same
    # prompt repeated would otherwise be a prefix-cache hit of all but its last block.
    if not llm.reset_prefix_cache():
        raise RuntimeError("requests still running: cannot reset the prefix cache")
    rid = f"lat-{time.monotonic_ns()}"
    start = time.perf_counter()
    engine.add_request(rid, prompt, SamplingParams(temperature=0, max_tokens=output_len,
                                                   ignore_eos=True))
    times: list[float] = []
    seen = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            n = len(out.outputs[0].token_ids)
            now = time.perf_counter()
            times += [now] * (n - seen)
            seen = n
    return _summarise(times[0] - start, times, start)


def run_llama_cpp_once(llm, prompt: list[int], output_len: int) -> dict:
    llm.reset()
    start = time.perf_counter()
    times: list[float] = []
    for _ in llm.generate(prompt, temp=0.0, reset=True):
        times.append(time.perf_counter())
        if len(times) == output_len:
            break
    return _summarise(times[0] - start, times, start)


def _aggregate(runs: list[dict]) -> dict:
    itl = sorted(x for r in runs for x in r["itl_ms"])
    pct = lambda p: itl[min(len(itl) - 1, int(p / 100 * len(itl)))]
    return {"runs": len(runs),
            "ttft_s": statistics.median(r["ttft_s"] for r in runs),
            "decode_tokens_per_s": statistics.median(r["decode_tokens_per_s"] for r in runs),
            "itl_p50_ms": pct(50), "itl_p90_ms": pct(90), "itl_p99_ms": pct(99),
            "e2e_s": statistics.median(r["e2e_s"] for r in runs),
            "itl_ms_first_run": runs[0]["itl_ms"]}


def run(args: argparse.Namespace) -> int:
    from tqdm.auto import tqdm

    from tokenmill import LLM
    from tokenmill.model_loader.default_model import default_model_path

    model = args.model or default_model_path()
    (req,) = load_workload(model, "single-stream", args.workload_seed)
    prompt, n_out = req.prompt_token_ids, args.output_len
    print(f"single-stream: {len(prompt)} prompt tokens, {n_out} output tokens")
    print(describe_machine())
    options = EngineArgs.cli_options(args)
    engines = {}
    # --compare-quantization: one engine per weight format, all in this run (their ratios
    # are what compares); else the one --quantization (or dense) engine.
    specs = args.compare_quantization.split(",") if args.compare_quantization else [None]
    for spec in specs:  # weight_specs.py
        with weights_as(spec) if spec else contextlib.nullcontext({}) as weights:
            llm = LLM(model, **(options | weights))
        label = "tokenmill" if spec is None else f"tokenmill {spec}"
        params, packed = weight_bytes(llm.engine.runner.model)
        print(f"{label}: weights held {params / 1e6:.0f} MB"
              + (f" + {packed / 1e6:.0f} MB oneDNN-packed copies" if packed else ""))
        engines[label] = lambda llm=llm: run_tokenmill_once(llm, prompt, n_out)
    if args.llama_cpp:
        threads = args.llama_cpp_threads or torch.get_num_threads()
        for label, f32 in [("", False)] + [(" F32", True)] * args.llama_cpp_f32:
            peer = load_llama_cpp(model, threads, f32)
            if peer is None:
                break
            engines[f"llama.cpp{label} (llama-cpp-python)"] = (
                lambda peer=peer: run_llama_cpp_once(peer, prompt, n_out))
    for once in engines.values():
        for _ in range(args.warmup):
            once()
    # Engines take turns, one request each per round: the machine's drift over the run hits
    # every engine alike, and their ratio is what a noisy machine can still measure.
    runs: dict[str, list[dict]] = {name: [] for name in engines}
    for _ in tqdm(range(args.repeats), desc="rounds (each engine once)"):
        for name, once in engines.items():
            runs[name].append(once())
    results = {name: _aggregate(r) for name, r in runs.items()}
    _print_results(results)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    if args.png:
        _plot(results, args.png)
    return 0


def _print_results(results: dict[str, dict]) -> None:
    """The table, then each tokenmill engine's ratios to the peers and to the tokenmill engines
    listed before it."""
    print(f"\n{'engine':<36}{'TTFT s':>8}{'decode tok/s':>14}{'ITL p50/p90/p99 ms':>22}"
          f"{'E2E s':>8}")
    for name, r in results.items():
        itl = f"{r['itl_p50_ms']:.1f}/{r['itl_p90_ms']:.1f}/{r['itl_p99_ms']:.1f}"
        print(f"{name:<36}{r['ttft_s']:>8.3f}{r['decode_tokens_per_s']:>14.1f}{itl:>22}"
              f"{r['e2e_s']:>8.2f}")
    for ours in [n for n in results if n.startswith("tokenmill")]:
        for name, r in results.items():
            if name == ours or (name.startswith("tokenmill") and list(results).index(name)
                                > list(results).index(ours)):
                continue
            print(f"{ours} / {name}: decode "
                  f"{results[ours]['decode_tokens_per_s'] / r['decode_tokens_per_s']:.2f}x, "
                  f"TTFT {r['ttft_s'] / results[ours]['ttft_s']:.2f}x faster")


def load_llama_cpp(model: str, threads: int, f32: bool):
    """llama-cpp-python on `model` (its F32 copy with `f32`), or None where it cannot run."""
    if not model.endswith(".gguf"):
        print("note: --llama-cpp needs a .gguf model; skipped")
        return None
    try:
        from llama_cpp import Llama
    except ImportError:
        print("note: llama-cpp-python is not installed (pip install llama-cpp-python); skipped")
        return None
    if f32:
        from tokenmill.bench.gguf_f32 import f32_copy

        model = f32_copy(model)
    return Llama(model, n_ctx=1024, n_threads=threads, n_batch=512, verbose=False)


def _plot(results: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.5))
    for name, r in results.items():
        ax.plot(r["itl_ms_first_run"], label=name, linewidth=0.8)
    ax.set_xlabel("output token")
    ax.set_ylabel("inter-token latency (ms)")
    ax.set_title("single-stream decode")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
