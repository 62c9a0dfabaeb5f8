"""Parallelism on this machine: the all-reduce, throughput under TP / PP / DP, the DP router.

    python benchmarks/parallel.py [--model PATH] [--parts allreduce,uniform,router]
                                  [--runs "TP=1,PP=2,..."] [--num-requests N]
                                  [--num-conversations 16] [engine options]

allreduce: two spawned ranks (one thread each) time a float32 all-reduce of T x 576 (SmolLM2's
hidden size; T = 1 is a batch-1 decode step) through gloo over loopback and through the
shared-memory op (csrc/shm_all_reduce.h). A TP step makes two per layer (60 for SmolLM2).
uniform: the `uniform` workload (shared/README.md), all requests at once, for each of --runs:
TP=3 with the shared-memory all-reduce and with gloo only (TOKENMILL_SHM_ALL_REDUCE=0); PP=2;
DP=1 and DP=2 through the server's engine front (the DP=1 row is the like-for-like base of
DP=2). Ratios to the first are of this run; greedy outputs are checked equal across the runs.
SmolLM2's 9 heads split over 1, 3 or 9 ranks only (TP=2 is refused, as vLLM refuses it).
router: the `multi-turn` workload (16 conversations x 4 turns, each turn resending its
history) over DP=2 with the cache_aware and the round_robin router: prefix-cache hits.
"""

from __future__ import annotations

import argparse
import asyncio
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


RUNS = {  # name: (engine options, TOKENMILL_SHM_ALL_REDUCE); "DP" runs go through the
    # server's engine front (AsyncLLM / DataParallelLLM, no HTTP), the others through LLM
    "TP=1": ({}, "1"),
    "TP=3 shm all-reduce": ({"tensor_parallel_size": 3}, "1"),
    "TP=3 gloo all-reduce": ({"tensor_parallel_size": 3}, "0"),
    "PP=2": ({"pipeline_parallel_size": 2}, "1"),
    "DP=1 (server front)": ({}, "1"),
    "DP=2 (server front)": ({"data_parallel_size": 2}, "1"),
}


async def _serve_all(front, prompts: list[list[int]], params: list) -> list:
    """Every prompt through an AsyncLLM / DataParallelLLM at once; the final outputs."""
    async def one(i: int):
        final = None
        async for out in await front.add_request(f"r{i}", prompts[i], params[i]):
            final = out
        return final

    return await asyncio.gather(*(one(i) for i in range(len(prompts))))


def _front(model: str, router: str, options: dict):
    """The server's engine front without HTTP: AsyncLLM over one engine (replicas 0: the
    uni executor, as the server runs it) or DataParallelLLM over replicas."""
    from tokenmill.engine.async_engine import AsyncLLM
    from tokenmill.engine.data_parallel import DataParallelLLM, make_replicas
    from tokenmill.engine_args import EngineArgs

    engines = make_replicas(EngineArgs.from_options(model, **options))
    front = (AsyncLLM(engines[0]) if len(engines) == 1
             else DataParallelLLM(engines, router))
    front.start()
    return front, engines


def uniform_part(model: str | None, num_requests: int | None, runs: list[str],
                 options: dict) -> None:
    from tokenmill import LLM, SamplingParams
    from tokenmill.bench.throughput import rates
    from tokenmill.bench.workloads import load_workload
    from tokenmill.model_loader.default_model import default_model_path

    model = model or default_model_path()
    reqs = load_workload(model, "uniform", 0, num_requests)
    prompts = [r.prompt_token_ids for r in reqs]
    params = [SamplingParams(temperature=0, max_tokens=r.output_len, ignore_eos=True)
              for r in reqs]
    results, outputs = {}, {}
    for name in runs:
        extra, shm = RUNS[name]
        os.environ["TOKENMILL_SHM_ALL_REDUCE"] = shm
        if name.startswith("DP"):
            front, _ = _front(model, "cache_aware", options | extra)
            start = time.perf_counter()
            outs = asyncio.run(_serve_all(front, prompts, params))
            seconds = time.perf_counter() - start
            front.shutdown()
        else:
            llm = LLM(model, **options, **extra)
            start = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            seconds = time.perf_counter() - start
            llm.engine.shutdown()
            del llm
        results[name] = rates(reqs, seconds)
        outputs[name] = [o.outputs[0].token_ids for o in outs]
    first = results[runs[0]]["total_tokens_per_s"]
    print(f"\nuniform workload: {len(reqs)} requests x (256 prompt + 128 output) tokens, "
          "all at once, greedy")
    print(f"{'run':<24}{'time s':>9}{'out tok/s':>11}{'total tok/s':>13}{'ratio':>9}")
    for name, r in results.items():
        print(f"{name:<24}{r['seconds']:>9.1f}{r['output_tokens_per_s']:>11.1f}"
              f"{r['total_tokens_per_s']:>13.1f}{r['total_tokens_per_s'] / first:>9.2f}")
    same = all(o == outputs[runs[0]] for o in outputs.values())
    print(f"greedy outputs identical across the runs: {same}")


def router_part(model: str | None, num_conversations: int, options: dict) -> None:
    """multi-turn (shared/README.md): the conversations at once, each one's turns in order,
    over DP=2 with each router; prefix-cache hits and prompt tokens computed."""
    from tokenmill import SamplingParams
    from tokenmill.bench.workloads import load_workload
    from tokenmill.model_loader.default_model import default_model_path

    model = model or default_model_path()
    turns = load_workload(model, "multi-turn", 0, num_conversations)
    convs = [turns[i:i + 4] for i in range(0, len(turns), 4)]

    async def conversation(front, c: int) -> None:
        for t, req in enumerate(convs[c]):
            params = SamplingParams(temperature=0, max_tokens=req.output_len, ignore_eos=True)
            async for _ in await front.add_request(f"c{c}t{t}", req.prompt_token_ids, params):
                pass

    async def all_of_them(front) -> None:
        await asyncio.gather(*(conversation(front, c) for c in range(len(convs))))

    print(f"\nmulti-turn workload: {len(convs)} conversations x 4 turns (each resends its "
          "history + 64 tokens, 64 out), conversations at once, DP=2")
    print(f"{'router':<14}{'time s':>9}{'hit tokens':>12}{'queried':>10}{'hit rate':>10}"
          f"{'computed per replica':>24}")
    for router in ("cache_aware", "round_robin"):
        front, engines = _front(model, router, options | {"data_parallel_size": 2})
        start = time.perf_counter()
        asyncio.run(all_of_them(front))
        seconds = time.perf_counter() - start
        stats = [e.stats() for e in engines]
        hits = sum(s.prefix_cache_hits for s in stats)
        queries = sum(s.prefix_cache_queries for s in stats)
        computed = [s.num_prompt_tokens_computed for s in stats]
        front.shutdown()
        print(f"{router:<14}{seconds:>9.1f}{hits:>12}{queries:>10}{hits / queries:>10.2f}"
              f"{str(computed):>24}")


def main() -> None:
    from tokenmill.bench.machine import describe_machine
    from tokenmill.engine_args import EngineArgs

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--parts", default="allreduce,uniform,router")
    p.add_argument("--num-requests", type=int, default=None)
    p.add_argument("--runs", default=",".join(RUNS),
                   help=f"uniform runs to compare, of: {', '.join(RUNS)}")
    p.add_argument("--num-conversations", type=int, default=16)
    EngineArgs.add_cli_args(p)
    args = p.parse_args()
    print(describe_machine())
    parts = args.parts.split(",")
    if "allreduce" in parts:
        allreduce_part()
    if "uniform" in parts:
        uniform_part(args.model, args.num_requests, args.runs.split(","),
                     EngineArgs.cli_options(args))
    if "router" in parts:
        router_part(args.model, args.num_conversations, EngineArgs.cli_options(args))


if __name__ == "__main__":
    main()
