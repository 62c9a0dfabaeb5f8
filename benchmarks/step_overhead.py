"""The engine's own work in a decode step, next to the model's, without the profiler.

    python benchmarks/step_overhead.py [--model PATH] [--steps 64] [--async-rounds 3]
                                       [--parts overhead,async,gc,detok] [--batches 1,64]
                                       [--gc-requests 4096] [--gc-rounds 2]
                                       [--tensor-parallel-size N]

For decode batches of 1 and 64 (--batches; SmolLM2 float32 unless --model), with outputs at every
step (cumulative: a server's streamed request) and at the end only (final_only: what LLM.generate
asks; --output-kinds), each step's wall time is
split into the model's forward pass and logits (timed around the model's own methods) and
everything else the engine does: scheduling, input tensors, attention metadata, sampling,
output processing (each timed around its function). Medians over --steps steps.

Then greedy sampling's argmax over (rows, vocab) logits: torch.argmax against the C++ pass
the sampler uses (layers/cpu_ops.py), alternated in rounds.

Then async scheduling (--async-scheduling): the same decode batches on an engine that schedules
step N+1 and processes step N's outputs while the model runs, against synchronous steps;
median ms between step() returns, rounds alternated between the engines. "inline" is async
scheduling with the launches on the engine's own thread, as on a GPU (executor/uniproc.py): on
CPU the forward pass is then not overlapped, so it shows what the step thread's hand-offs cost.

Then (gc) the cyclic garbage collector's pauses during one offline run (--gc-requests requests
of 32 prompt tokens and 64 output tokens, up to 1024 at once), each engine in a fresh process:
as started (its start-up heap frozen, utils/gc_heap.py) against the same engine with that heap
unfrozen (gc.unfreeze() after start: what every engine did before), rounds alternated.

Then (detok) incremental detokenization, µs per output token, the model's tokenizer streaming
through tokenizers' DecodeStream against the same tokenizer decoding a window twice per token
(engine/detokenizer.py's two paths), on multilingual text, alternated rounds: a cost the engine
pays for every running request at every step.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import subprocess
import sys
import time
from collections import defaultdict
from typing import Any

import torch

from tokenmill import LLM, RequestOutputKind, SamplingParams
from tokenmill.attention import input_batch
from tokenmill.bench.alternate import alternate
from tokenmill.bench.machine import describe_machine
from tokenmill.layers import cpu_ops

Timings = dict[str, list[float]]


def _timed(owner: Any, name: str, key: str, timings: Timings) -> None:
    """Replace owner.name by a wrapper that records its wall time under `key`."""
    fn = getattr(owner, name)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        result = fn(*args, **kwargs)
        timings[key].append(time.perf_counter() - t0)
        return result

    setattr(owner, name, wrapper)


def instrument(llm: LLM) -> Timings:
    timings: Timings = defaultdict(list)
    eng, runner = llm.engine, llm.engine.runner
    _timed(eng.scheduler, "schedule", "schedule", timings)
    _timed(runner.model, "forward", "forward", timings)
    _timed(runner.model, "compute_logits", "logits", timings)
    _timed(runner.backend, "build_metadata", "metadata", timings)
    _timed(type(runner.sampler), "__call__", "sample", timings)
    _timed(eng.scheduler, "update_from_output", "update", timings)
    _timed(eng.outputs, "process", "process", timings)
    _timed(input_batch.InputBatch, "build", "inputs", timings)
    return timings


def start_decode_batch(llm: LLM, batch: int, prompt_len: int, max_tokens: int,
                       tag: str, kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
                       ) -> None:
    """`batch` requests prefilled (chunked) until every one decodes."""
    eng = llm.engine
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True,
                            output_kind=kind)
    for i in range(batch):
        eng.add_request(f"{tag}-{i}", [1000 + (i * 7 + j) % 40000 for j in range(prompt_len)],
                        params)
    while eng.scheduler.num_waiting:
        eng.step()
    eng.step()


def step_walls(llm: LLM) -> list[float]:
    """Seconds between step() returns until the batch is done."""
    walls = []
    while llm.engine.has_unfinished_requests():
        t0 = time.perf_counter()
        llm.engine.step()
        walls.append(time.perf_counter() - t0)
    return walls


def decode_steps(llm: LLM, timings: Timings, batch: int, prompt_len: int, steps: int,
                 kind: RequestOutputKind) -> dict[str, float]:
    """Median ms per decode step of each part, for `batch` requests decoding together."""
    start_decode_batch(llm, batch, prompt_len, steps + 1, f"b{batch}-{kind.name}", kind)
    timings.clear()
    walls = step_walls(llm)
    med = lambda xs: statistics.median(xs) * 1e3
    parts = {"wall": med(walls)}
    parts.update({k: med(v) for k, v in timings.items()})
    parts["outputs"] = parts.pop("update") + parts.pop("process")
    parts["engine"] = parts["wall"] - parts["forward"] - parts["logits"]
    return parts


def step_wall(llm: LLM, batch: int, prompt_len: int, steps: int, tag: str) -> float:
    """Median ms per decode step (between step() returns) for `batch` decoding requests."""
    start_decode_batch(llm, batch, prompt_len, steps + 2, tag)
    llm.engine.step()  # async: the pipeline is full from here
    return statistics.median(step_walls(llm)[:-2]) * 1e3  # the last steps drain the batch


def async_part(model: str | None, steps: int, rounds: int, tp: int = 1) -> None:
    """Each (mode, round) in a fresh process, modes alternated: two engines in one process
    share a machine's OpenMP pools and disturb each other's figures."""
    print(f"\nasync scheduling: ms per decode step (median over {steps} steps; "
          f"{rounds} alternated rounds each, each in a fresh process; "
          f"tensor_parallel_size={tp})")
    got: dict[tuple[str, int], list[float]] = defaultdict(list)
    for _ in range(rounds):
        for mode in ("sync", "async", "inline"):
            cmd = [sys.executable, __file__, "--probe", mode, "--steps", str(steps),
                   "--tensor-parallel-size", str(tp)]
            if model:
                cmd += ["--model", model]
            out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
            for batch, ms in json.loads(out.strip().splitlines()[-1]).items():
                got[(mode, int(batch))].append(ms)
    print(f"{'batch':>5}{'sync':>10}{'async':>10}{'inline':>10}{'saved':>10}{'saved %':>9}")
    for batch in (1, 64):
        sync, asyn, inline = (statistics.median(got[(m, batch)])
                              for m in ("sync", "async", "inline"))
        print(f"{batch:>5}{sync:>10.3f}{asyn:>10.3f}{inline:>10.3f}{sync - asyn:>10.3f}"
              f"{100 * (sync - asyn) / sync:>8.1f}%   rounds: "
              + " | ".join(f"{m} " + " ".join(f"{x:.2f}" for x in got[(m, batch)])
                           for m in ("sync", "async", "inline")))


def gc_part(model: str | None, requests: int, rounds: int) -> None:
    print(f"\ngarbage collector pauses in one offline run ({requests} requests, 32 + 64 "
          f"tokens, max_num_seqs 1024; {rounds} alternated rounds, fresh processes)")
    got: dict[str, list[dict]] = defaultdict(list)
    for _ in range(rounds):
        for mode in ("frozen", "unfrozen"):
            cmd = [sys.executable, __file__, "--probe", f"gc-{mode}",
                   "--gc-requests", str(requests)] + (["--model", model] if model else [])
            out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
            got[mode].append(json.loads(out.strip().splitlines()[-1]))
    print(f"{'heap':>9}{'gen-2':>7}{'gen-2 ms':>10}{'max ms':>8}{'gen-0/1 ms':>11}"
          f"{'run s':>8}{'step p50':>9}{'p99':>8}{'max':>8}")
    for mode, runs in got.items():
        for r in runs:
            print(f"{mode:>9}{r['gen2']:>7}{r['gen2_ms']:>10.1f}{r['gen2_max_ms']:>8.1f}"
                  f"{r['young_ms']:>11.1f}{r['run_s']:>8.2f}{r['p50_ms']:>9.2f}"
                  f"{r['p99_ms']:>8.2f}{r['max_ms']:>8.2f}")


def probe_gc(model: str | None, frozen: bool, requests: int) -> None:
    """One offline run; print the collector's pauses and the step times as JSON."""
    llm = LLM(model, max_num_seqs=1024)
    if not frozen:
        gc.unfreeze()
    pauses: list[tuple[int, float]] = []
    began: list[float] = []

    def on_gc(phase: str, info: dict) -> None:
        if phase == "start":
            began.append(time.perf_counter())
        else:
            pauses.append((info["generation"], time.perf_counter() - began.pop()))

    eng = llm.engine
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    for i in range(requests):
        eng.add_request(f"gc-{i}", [1000 + (i * 7 + j) % 40000 for j in range(32)], params)
    gc.callbacks.append(on_gc)
    t0 = time.perf_counter()
    walls = step_walls(llm)
    run_s = time.perf_counter() - t0
    gc.callbacks.remove(on_gc)
    old = [d for g, d in pauses if g == 2]
    q = statistics.quantiles(walls, n=100)
    print(json.dumps({"gen2": len(old), "gen2_ms": sum(old) * 1e3,
                      "gen2_max_ms": max(old, default=0.0) * 1e3,
                      "young_ms": sum(d for g, d in pauses if g < 2) * 1e3, "run_s": run_s,
                      "p50_ms": q[49] * 1e3, "p99_ms": q[98] * 1e3, "max_ms": max(walls) * 1e3}))


def probe(model: str | None, mode: str, steps: int, tp: int) -> None:
    """One engine, one mode: print {batch: ms per decode step} as JSON."""
    if mode == "inline":  # async launches on the engine's thread, as on a GPU
        from tokenmill.executor.uniproc import UniProcExecutor

        UniProcExecutor.STEP_THREAD_DEVICES = frozenset()
    llm = LLM(model, async_scheduling=mode != "sync", tensor_parallel_size=tp)
    print(json.dumps({batch: step_wall(llm, batch, prompt_len, steps, f"p{batch}")
                      for batch, prompt_len in ((1, 128), (64, 32))}))
    llm.engine.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--async-rounds", type=int, default=3)
    parser.add_argument("--parts", default="overhead,async,detok",
                        help="overhead (with the argmax comparison), async, gc, detok")
    parser.add_argument("--output-kinds", default="cumulative,final_only",
                        help="overhead part: the requests' output kinds (a server's streamed "
                        "request is cumulative; LLM.generate asks final_only)")
    parser.add_argument("--gc-requests", type=int, default=4096)
    parser.add_argument("--gc-rounds", type=int, default=2)
    parser.add_argument("--batches", default="1,64",
                        help="overhead part: the decode batch sizes")
    parser.add_argument("--tensor-parallel-size", type=int, default=1,
                        help="async part: the engines' TP size (worker processes above 1)")
    parser.add_argument("--probe", choices=["sync", "async", "inline", "gc-frozen",
                                            "gc-unfrozen"], default=None,
                        help=argparse.SUPPRESS)  # one async_part or gc_part measurement
    args = parser.parse_args()
    if args.probe and args.probe.startswith("gc-"):
        return probe_gc(args.model, args.probe == "gc-frozen", args.gc_requests)
    if args.probe:
        return probe(args.model, args.probe, args.steps, args.tensor_parallel_size)
    print(describe_machine())
    batches = [int(b) for b in args.batches.split(",")]
    if "overhead" in args.parts or "detok" in args.parts:
        llm = LLM(args.model, max_num_seqs=max(256, *batches))
        if "overhead" in args.parts:
            overhead_part(llm, args.steps, batches,
                          [RequestOutputKind[k.upper()] for k in args.output_kinds.split(",")])
            if cpu_ops.ops_available():
                argmax_part(llm)
        if "detok" in args.parts:
            detok_part(llm)
        del llm
    if "async" in args.parts:
        async_part(args.model, args.steps, args.async_rounds, args.tensor_parallel_size)
    if "gc" in args.parts:
        gc_part(args.model, args.gc_requests, args.gc_rounds)


def overhead_part(llm: LLM, steps: int, batches: list[int],
                  kinds: list[RequestOutputKind]) -> None:
    timings = instrument(llm)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads\n")
    cols = ["wall", "forward", "logits", "engine", "schedule", "inputs", "metadata", "sample",
            "outputs"]
    print("batch " + "".join(f"{c:>10}" for c in cols) + "   (ms per decode step, medians)")
    for batch in batches:
        for kind in kinds:
            parts = decode_steps(llm, timings, batch, 128 if batch == 1 else 32, steps, kind)
            print(f"{batch:>5} " + "".join(f"{parts[c]:>10.3f}" for c in cols)
                  + f"   {kind.name}")


def argmax_part(llm: LLM) -> None:
    print("\ngreedy argmax over the vocabulary, µs per call (alternated rounds):")
    vocab = llm.engine.config.model.vocab_size
    for rows in (1, 64):
        logits = torch.randn(rows, vocab)
        res = alternate({"torch.argmax": lambda x=logits: x.argmax(dim=-1),
                         "C++ argmax_rows": lambda x=logits: cpu_ops.argmax(x)},
                        rounds=6, calls=200, warmup=10)
        t, c = res["torch.argmax"] * 1e6, res["C++ argmax_rows"] * 1e6
        print(f"  ({rows}, {vocab}): torch.argmax {t:8.1f}   C++ {c:8.1f}   {t / c:5.1f}x")



class _WindowOnly:
    """A tokenizer seen without its Rust backend: the detokenizer's decoded-window path."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def decode(self, ids: list[int], **kwargs: Any) -> str:
        return self.tokenizer.decode(ids, **kwargs)


def detok_part(llm: LLM) -> None:
    from tokenmill.engine.detokenizer import IncrementalDetokenizer

    tok = llm.get_tokenizer()
    ids = tok.encode("Le café coûte 3 € — 日本語のテキスト, emoji 😀🚀, and plain English "
                     "words with punctuation; tabs\tand newlines.\n" * 8)
    prompt = tok.encode("Write something:")

    def stream(t: Any) -> None:
        detok = IncrementalDetokenizer(t, prompt, skip_special_tokens=True)
        for i in ids:
            detok.add_tokens([i])

    res = alternate({"DecodeStream": lambda: stream(tok),
                     "decoded window": lambda: stream(_WindowOnly(tok))},
                    rounds=7, calls=3, warmup=1)
    per = {k: v / len(ids) * 1e6 for k, v in res.items()}
    print(f"\nincremental detokenization, µs per output token ({len(ids)} tokens, "
          f"{type(tok).__name__}; 7 alternated rounds):")
    for name, us in per.items():
        print(f"  {name:<16}{us:8.2f}")
    print(f"  window / stream {per['decoded window'] / per['DecodeStream']:6.1f}x")


if __name__ == "__main__":
    main()
