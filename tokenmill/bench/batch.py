"""One offline batch through the engine's step loop, every request submitted at once: the
outputs and each request's time to first token (benchmarks of prefix caching and KV tiers)."""

from __future__ import annotations

import itertools
import time

from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.sampling_params import SamplingParams

_batch_ids = itertools.count()


def run_batch(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams
              ) -> tuple[list[list[int]], list[float]]:
    """Submit all at once; the outputs' token ids and each request's TTFT (seconds), in the
    prompts' order."""
    batch = next(_batch_ids)
    ids = [f"batch{batch}-{i}" for i in range(len(prompts))]
    start = time.perf_counter()
    for rid, p in zip(ids, prompts, strict=True):
        engine.add_request(rid, p, params)
    ttft: dict[str, float] = {}
    outs: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id not in ttft and out.outputs[0].token_ids:
                ttft[out.request_id] = time.perf_counter() - start
            if out.finished:
                outs[out.request_id] = out.outputs[0].token_ids
    return [outs[r] for r in ids], [ttft[r] for r in ids]
