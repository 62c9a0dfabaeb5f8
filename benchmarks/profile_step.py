"""Where an engine step's time goes: a torch.profiler breakdown of decode and mixed steps.

    python benchmarks/profile_step.py [--scenario single|decode64|mixed|all] [--steps 10]
                                      [--no-prepack-weights] [--attention-backend torch]
                                      [--quantization none|int8|gguf...] [--int8-activations]
                                      [--matmul-dtype auto|float32|bfloat16]
                                      [--kv-cache-dtype auto|bfloat16|int8|fp8]
                                      [--json out.json] [--ops N]
    python benchmarks/profile_step.py --model llama-1b --device cuda --scenario decode64 \
                                      [--enforce-eager] --ops 15      (the GPU)

Scenarios (SmolLM2 in the default weight format unless --model / --quantization; --model
may be a shape name of tokenmill/bench/shapes.py, random weights of a real shape):
- single:   one request, 128 prompt tokens, decode steps (batch 1);
- decode64: 64 requests of 256 prompt tokens (the `uniform` workload), decode steps at batch 64;
- mixed:    the `mixed` workload (128 requests at once), steps 8.. of the run, where prefill
            chunks and decodes share the step.

Each scenario first times --steps steps without the profiler (the honest wall time), then
replays the same steps under the profiler (prefix caching off, so the replay does the same
work) and splits them into the engine's named scopes (schedule,
prepare_inputs, forward, logits, sample, process_outputs) and, inside forward, into GEMMs,
attention and the rest (norms, RoPE, activations, copies). A step whose layers run in one C++
call (models/cpu_decode.py: by default every CPU step its kernels cover) shows that call as
forward.fused_layers (its GEMMs, attention and ops are not split); --no-fused-decode runs those
steps through the modules, which the profiler can split.

On CUDA the scopes are the host's time (the device runs behind it) and the profiler also
records the device: its kernels' time a step, and with --ops the kernels of most device time
(inside a CUDA graph replay too), beside the ops of most host time. A third run of the same
steps under torch's sync debug mode counts where the host waited for the device, by line
(utils/host_syncs.py).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tokenmill import LLM, SamplingParams  # noqa: E402
from tokenmill.bench.shapes import SHAPES, write_model_folder  # noqa: E402
from tokenmill.bench.workloads import make_workload  # noqa: E402
from tokenmill.utils.host_syncs import HostSyncs  # noqa: E402

GEMM_OPS = {"mkldnn::_linear_pointwise", "aten::mm", "aten::addmm",
            "tokenmill::linear"}
FUSED = "tokenmill::decode_layers"
SCOPES = ["schedule", "prepare_inputs", "forward", "logits", "sample", "process_outputs"]


def _inside(event, name: str) -> bool:
    parent = event.cpu_parent
    while parent is not None:
        if parent.name == name:
            return True
        parent = parent.cpu_parent
    return False


def breakdown(prof, steps: int) -> dict[str, float]:
    """ms per step for each scope, and forward split into gemm / attention / other."""
    ms = dict.fromkeys([*SCOPES, "forward.gemm", "forward.attention", "forward.fused_layers",
                        "forward.other"], 0.0)
    for e in prof.events():
        if e.name in SCOPES:
            ms[e.name] += e.cpu_time_total / 1e3
        elif e.name == FUSED and _inside(e, "forward"):
            ms["forward.fused_layers"] += e.cpu_time_total / 1e3
        elif e.name == "attention" and _inside(e, "forward"):
            ms["forward.attention"] += e.cpu_time_total / 1e3
        elif e.name in GEMM_OPS and _inside(e, "forward") and not _inside(e, "attention"):
            ms["forward.gemm"] += e.self_cpu_time_total / 1e3
    ms["forward.other"] = (ms["forward"] - ms["forward.gemm"] - ms["forward.attention"]
                           - ms["forward.fused_layers"])
    return {k: v / steps for k, v in ms.items()}


def _submit(llm: LLM, prompts: list[list[int]], outputs: list[int]) -> None:
    for i, (p, n) in enumerate(zip(prompts, outputs, strict=True)):
        llm.engine.add_request(f"p{time.monotonic_ns()}-{i}", p,
                               SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))


def _drain(llm: LLM) -> None:
    while llm.engine.has_unfinished_requests():
        llm.engine.step()


def _advance(llm: LLM, name: str, vocab: int, special: set[int]) -> None:
    """Submit the scenario's requests and step to where the measured steps start."""
    workload = {"single": "single-stream", "decode64": "uniform", "mixed": "mixed"}[name]
    reqs = make_workload(workload, vocab, special)
    _submit(llm, [r.prompt_token_ids for r in reqs], [r.output_len for r in reqs])
    if name == "decode64":  # step until every request has left prefill
        sched = llm.engine.scheduler
        while any(r.num_computed_tokens < r.num_prompt_tokens
                  for r in sched.running + list(sched.waiting)):
            llm.engine.step()
    for _ in range({"single": 4, "decode64": 0, "mixed": 8}[name]):
        llm.engine.step()


def run_scenario(llm: LLM, name: str, steps: int, vocab: int, special: set[int]) -> dict:
    """The same steps twice (the prefix cache is off, so both runs do the same work): timed
    without the profiler, then profiled."""
    _advance(llm, name, vocab, special)
    cuda = llm.engine.runner.device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    sync()
    start = time.perf_counter()
    for _ in range(steps):
        llm.engine.step()
    sync()
    wall_ms = (time.perf_counter() - start) * 1e3 / steps
    _drain(llm)
    _advance(llm, name, vocab, special)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        for _ in range(steps):
            llm.engine.step()
        sync()
    _drain(llm)
    syncs = _count_host_syncs(llm, name, steps, vocab, special) if cuda else None
    events = prof.key_averages()
    ops = sorted(events, key=lambda e: -e.self_cpu_time_total)
    # the device's own events (kernels, copies); a CPU op's row repeats its kernels' time
    kernels = sorted((e for e in events if e.device_type == DeviceType.CUDA),
                     key=lambda e: -e.self_device_time_total)
    return {"scenario": name, "wall_ms_per_step": wall_ms,
            "profiled_ms_per_step": breakdown(prof, steps),
            "top_ops_ms_per_step": {e.key: e.self_cpu_time_total / 1e3 / steps for e in ops[:30]},
            "device_ms_per_step": sum(e.self_device_time_total for e in kernels) / 1e3 / steps,
            "device_ops_per_step": sum(e.count for e in kernels) / steps,
            "top_kernels_ms_per_step": {e.key: e.self_device_time_total / 1e3 / steps
                                        for e in kernels[:30]},
            "top_kernels_calls_per_step": {e.key: e.count / steps for e in kernels[:30]},
            "host_syncs_per_step": None if syncs is None else syncs.total / steps,
            "host_sync_sites_per_step": None if syncs is None else {
                site: n / steps for site, n in syncs.sites.most_common()}}


def _count_host_syncs(llm: LLM, name: str, steps: int, vocab: int,
                      special: set[int]) -> HostSyncs:
    """The same steps a third time under torch's sync debug mode: each point where the host
    waited for the device, by the line that asked (a sync inside the step serializes the
    host's work with the device's)."""
    _advance(llm, name, vocab, special)
    with HostSyncs() as syncs:
        for _ in range(steps):
            llm.engine.step()
    _drain(llm)
    return syncs


def print_result(r: dict, top_ops: int = 0) -> None:
    b = r["profiled_ms_per_step"]
    total = sum(b[s] for s in SCOPES)
    print(f"\n{r['scenario']}: {r['wall_ms_per_step']:.1f} ms a step without the profiler; "
          f"profiled scopes {total:.1f} ms")
    for key in ["schedule", "prepare_inputs", "forward", "forward.gemm", "forward.attention",
                "forward.fused_layers", "forward.other", "logits", "sample", "process_outputs"]:
        if key == "forward.fused_layers" and not b[key]:
            continue
        indent = "    " if key.startswith("forward.") else "  "
        print(f"{indent}{key:<22}{b[key]:>9.1f} ms {100 * b[key] / total:>6.1f}%")
    if r["top_kernels_ms_per_step"]:
        print(f"  device: kernels {r['device_ms_per_step']:.1f} ms a step, "
              f"{r['device_ops_per_step']:.0f} kernels and copies a step")
    if r["host_syncs_per_step"] is not None:
        print(f"  host waits for the device: {r['host_syncs_per_step']:.1f} a step")
        for site, n in r["host_sync_sites_per_step"].items():
            print(f"    {site[:64]:<64}{n:>5.1f}")
    if top_ops:
        print("  ops by self time (host):")
        for op, ms in list(r["top_ops_ms_per_step"].items())[:top_ops]:
            print(f"    {op[:60]:<60}{ms:>9.2f} ms")
        if r["top_kernels_ms_per_step"]:
            print("  kernels by device time:")
            calls = r["top_kernels_calls_per_step"]
            for op, ms in list(r["top_kernels_ms_per_step"].items())[:top_ops]:
                print(f"    {op[:60]:<60}{ms:>9.2f} ms {calls[op]:>6.0f} a step")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--scenario", default="all", choices=["single", "decode64", "mixed", "all"])
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--no-prepack-weights", dest="prepack", action="store_false")
    ap.add_argument("--attention-backend", default="auto",
                    choices=["auto", "torch", "cpu", "triton"])
    ap.add_argument("--device", default=None, help="cpu or cuda (default: cuda when present)")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--enforce-eager", action="store_true", help="CUDA: no decode graphs")
    ap.add_argument("--no-fused-decode", dest="fused", action="store_false",
                    help="steps through the modules' Python loop, not one C++ call")
    ap.add_argument("--quantization", default=None,
                    help="weight format (tokenmill serve's --quantization); default: the model's")
    ap.add_argument("--int8-activations", action="store_true")
    ap.add_argument("--kv-cache-dtype", default="auto")
    ap.add_argument("--matmul-dtype", default="auto")
    ap.add_argument("--json", default=None)
    ap.add_argument("--ops", type=int, default=0, help="also print the N ops of most self time")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        shape = args.model in SHAPES
        model = str(write_model_folder(args.model, Path(tmp))) if shape else args.model
        llm = LLM(model, load_format="dummy" if shape else "auto", device=args.device,
                  dtype=args.dtype, enforce_eager=args.enforce_eager,
                  prepack_weights=args.prepack, attention_backend=args.attention_backend,
                  enable_prefix_caching=False, quantization=args.quantization,
                  int8_activations=args.int8_activations, kv_cache_dtype=args.kv_cache_dtype,
                  matmul_dtype=args.matmul_dtype,
                  # synchronous steps (the CUDA default runs each step ahead on its own
                  # thread): the scopes then add up to the step
                  async_scheduling=False)
        profile_engine(llm, args)


def profile_engine(llm: LLM, args: argparse.Namespace) -> None:
    stack = llm.engine.runner.model.model
    if hasattr(stack, "fused_layers"):  # the CPU's one-call decode (models/cpu_decode.py)
        stack.fused_layers.enabled = args.fused
    tok = llm.get_tokenizer()
    vocab = llm.engine.config.model.vocab_size
    device = llm.engine.runner.device
    where = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    print(f"torch {torch.__version__}, {where}, {torch.get_num_threads()} threads, "
          f"enforce_eager={args.enforce_eager}, "
          f"prepack_weights={args.prepack}, attention_backend={args.attention_backend}, "
          f"fused_decode={args.fused}, quantization={llm.engine.config.model.quantization}, "
          f"matmul_dtype={llm.engine.config.model.matmul_dtype}, "
          f"kv_cache_dtype={llm.engine.config.cache.kv_cache_dtype}")
    names = ["single", "decode64", "mixed"] if args.scenario == "all" else [args.scenario]
    results = []
    for name in names:
        results.append(run_scenario(llm, name, args.steps, vocab, set(tok.all_special_ids)))
        print_result(results[-1], args.ops)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
