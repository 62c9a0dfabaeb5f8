"""What a server's streams hold for clients that stop reading: `--requests` requests of
`--max-tokens` tokens on AsyncLLM (the server's engine thread), whose readers do not read
until every request has finished (a stalled client), then read everything.

Printed, of the second of two such rounds (the first puts the steps' buffers in place): the
Python heap allocated over the round and still held when the last step's outputs have come
(tracemalloc: the outputs waiting for their readers, which an RSS figure loses among the
steps' own memory), the reads each request took, and the wall time (tracing slows it).
Before streams coalesced (engine/request_stream.py), every step's output waited, and a server
stream asked CUMULATIVE outputs (each holding every token so far): a stalled request held
O(tokens^2). Now it holds one output. Run it in two trees to compare (`PYTHONPATH=<tree>`);
`--output-kind` is what the server asks: cumulative before, delta now.

    python benchmarks/stream_backlog.py [--model PATH] [--requests 64] [--max-tokens 512]
                                        [--logprobs 5] [--output-kind delta]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import time
import tracemalloc

from tokenmill import LLM, RequestOutputKind, SamplingParams
from tokenmill.bench.machine import describe_machine


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="default: the shipped SmolLM2 file")
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=512)
    p.add_argument("--logprobs", type=int, default=None, help="top logprobs a token")
    p.add_argument("--output-kind", choices=["cumulative", "delta"], default="delta")
    return p.parse_args(argv)


async def _stalled_round(engine, args: argparse.Namespace) -> tuple[float, list[int], float]:
    """(Python heap MiB allocated since the round began and still held when the last step's
    outputs have come, nothing read yet; reads per request; wall seconds)."""
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True,
                            logprobs=args.logprobs,
                            output_kind=RequestOutputKind[args.output_kind.upper()])
    gc.collect()
    tracemalloc.start()
    t0 = time.perf_counter()
    streams = [await engine.add_request(f"stall-{i}", {"prompt_token_ids": [5 + i % 50, 6, 7]},
                                        params) for i in range(args.requests)]
    # the loop runs (outputs are handed over) while no one reads: until the engine thread
    # has taken the requests in, then until it has finished them
    started = time.monotonic()
    while not engine.engine.has_unfinished_requests() and time.monotonic() - started < 10:
        await asyncio.sleep(0.01)
    while engine.engine.has_unfinished_requests():
        await asyncio.sleep(0.05)
    await asyncio.sleep(0.2)  # the last step's outputs reach the loop
    gc.collect()
    held = tracemalloc.get_traced_memory()[0] / 2**20
    tracemalloc.stop()

    async def read(stream) -> int:
        return sum([1 async for _ in stream])

    reads = await asyncio.gather(*(read(s) for s in streams))
    return held, list(reads), time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from tokenmill.engine.async_engine import AsyncLLM

    print(describe_machine())
    llm = LLM(args.model) if args.model else LLM()
    engine = AsyncLLM(llm.engine)
    engine.start()
    try:  # the same round twice: the steps' buffers and the KV cache are in place for the second
        asyncio.run(_stalled_round(engine, args))
        held, reads, wall = asyncio.run(_stalled_round(engine, args))
    finally:
        engine.shutdown()
    print(f"{args.requests} requests x {args.max_tokens} tokens, logprobs {args.logprobs}, "
          f"{args.output_kind} outputs, read after the last step: Python heap held "
          f"{held:.1f} MiB; "
          f"reads a request {min(reads)}-{max(reads)}; {wall:.1f} s")
    return 0
