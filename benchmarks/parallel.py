"""Tensor parallelism on this machine: the all-reduce, then offline throughput.

    python benchmarks/parallel.py [--model PATH] [--parts allreduce,uniform]
                                  [--tp-sizes 1,3] [--num-requests N] [engine options]

allreduce: two spawned ranks (one thread each) time a float32 all-reduce of T x 576 (SmolLM2's
hidden size; T = 1 is a batch-1 decode step) through gloo over loopback and through the
shared-memory op (csrc/shm_all_reduce.h). A TP step makes two per layer (60 for SmolLM2).
uniform: the `uniform` workload (shared/README.md) offline at each of --tp-sizes, above 1 both
with the shared-memory all-reduce and with gloo only (TOKENMILL_SHM_ALL_REDUCE=0); ratios to
the first are of this run. Greedy outputs are checked equal across the runs. SmolLM2's 9 heads
split over 1, 3 or 9 ranks only (TP=2 is refused at start-up, as vLLM refuses it).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

ROWS = (1, 16, 64, 256)
HIDDEN = 576
REPEATS = 400


def _allreduce_rank(rank: int, world: int, init: str, shm_path: str, q: mp.Queue) -> None:
    import torch

    from tokenmill.distributed.shm_all_reduce import ShmAllReduce

    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", init_method=init, rank=rank,
                                         world_size=world)
    comm = ShmAllReduce(shm_path, rank, world)
    results = {}
    for rows in ROWS:
        x = torch.randn(rows, HIDDEN)
        for name, fn in (("gloo", torch.distributed.all_reduce), ("shm", comm.all_reduce)):
            times = []
            for i in range(REPEATS):
                if i % 100 == 0:  # start each round together
                    torch.distributed.barrier()
                t0 = time.perf_counter()
                fn(x)
                times.append(time.perf_counter() - t0)
            results[(name, rows)] = statistics.median(times) * 1e6
    q.put((rank, results))
    torch.distributed.destroy_process_group()


def allreduce_part() -> None:
    from tokenmill.distributed import shm_all_reduce

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    ctx = mp.get_context("spawn")
    world = 2
    with tempfile.TemporaryDirectory() as tmp:
        shm_path = shm_all_reduce.create_segment(world)
        q = ctx.Queue()
        init = f"file://{tmp}/rendezvous"
        procs = [ctx.Process(target=_allreduce_rank, args=(r, world, init, shm_path, q))
                 for r in range(world)]
        for p in procs:
            p.start()
        results = dict(q.get(timeout=600) for _ in procs)
        for p in procs:
            p.join()
        os.unlink(shm_path)
    print(f"\nall-reduce of T x {HIDDEN} float32 between {world} processes, median of "
          f"{REPEATS} (µs; rank 0)")
    print(f"{'T':>6}{'gloo':>10}{'shm':>10}{'gloo/shm':>10}")
    for rows in ROWS:
        g, s = results[0][("gloo", rows)], results[0][("shm", rows)]
        print(f"{rows:>6}{g:>10.1f}{s:>10.1f}{g / s:>10.1f}")


def uniform_part(model: str | None, num_requests: int | None, tp_sizes: list[int],
                 options: dict) -> None:
    from tokenmill import LLM, SamplingParams
    from tokenmill.bench.throughput import rates
    from tokenmill.bench.workloads import load_workload
    from tokenmill.model_loader.default_model import default_model_path

    model = model or default_model_path()
    reqs = load_workload(model, "uniform", 0, num_requests)
    params = [SamplingParams(temperature=0, max_tokens=r.output_len, ignore_eos=True)
              for r in reqs]
    options = {k: v for k, v in options.items() if k != "tensor_parallel_size"}
    runs = [(f"TP={tp}" + ("" if tp == 1 else f" {name} all-reduce"), tp, flag)
            for tp in tp_sizes for name, flag in (("shm", "1"), ("gloo", "0"))
            if tp > 1 or flag == "1"]
    results, outputs = {}, {}
    for name, tp, shm in runs:
        os.environ["TOKENMILL_SHM_ALL_REDUCE"] = shm
        llm = LLM(model, tensor_parallel_size=tp, **options)
        start = time.perf_counter()
        outs = llm.generate([r.prompt_token_ids for r in reqs], params, use_tqdm=False)
        results[name] = rates(reqs, time.perf_counter() - start)
        outputs[name] = [o.outputs[0].token_ids for o in outs]
        llm.engine.shutdown()
        del llm
    first_name = runs[0][0]
    first = results[first_name]["total_tokens_per_s"]
    print(f"\nuniform workload: {len(reqs)} requests x (256 prompt + 128 output) tokens, "
          "offline, greedy")
    print(f"{'run':<24}{'time s':>9}{'out tok/s':>11}{'total tok/s':>13}{'ratio':>9}")
    for name, r in results.items():
        print(f"{name:<24}{r['seconds']:>9.1f}{r['output_tokens_per_s']:>11.1f}"
              f"{r['total_tokens_per_s']:>13.1f}{r['total_tokens_per_s'] / first:>9.2f}")
    same = all(o == outputs[first_name] for o in outputs.values())
    print(f"greedy outputs identical across the runs: {same}")


def main() -> None:
    from tokenmill.bench.machine import describe_machine
    from tokenmill.cli import add_engine_args, engine_options

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--parts", default="allreduce,uniform")
    p.add_argument("--num-requests", type=int, default=None)
    p.add_argument("--tp-sizes", default="1,3", help="tensor-parallel sizes to compare")
    add_engine_args(p)
    args = p.parse_args()
    print(describe_machine())
    parts = args.parts.split(",")
    if "allreduce" in parts:
        allreduce_part()
    if "uniform" in parts:
        uniform_part(args.model, args.num_requests,
                     [int(x) for x in args.tp_sizes.split(",")], engine_options(args))


if __name__ == "__main__":
    main()
