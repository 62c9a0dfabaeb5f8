"""Offline throughput with per-request latencies: every request submitted at once to the
engine's step loop (what `LLM.generate` does), timed per token as it comes out, and the
Hugging Face static-batching reference on the same requests (benchmarks/offline_throughput.py).

Figures, as vLLM's offline and serving benchmarks name them: output tokens/s (generated tokens
over the wall time), total tokens/s (prompt + generated), TTFT (submission to a request's first
token; every request is submitted at t = 0, so it includes the queueing of a full batch) and
ITL (the gap between a request's consecutive tokens). Every request sets ignore_eos, so the
token counts are the workload's and are checked.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from tokenmill.bench.serving import percentile
from tokenmill.bench.workloads import BenchRequest
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.metrics.stats import RequestTimings
from tokenmill.sampling_params import RequestOutputKind, SamplingParams


@dataclass
class OfflineResult:
    seconds: float
    output_tokens: int
    total_tokens: int
    ttft_s: list[float]  # one per request
    itl_s: list[float]  # one per generated token after a request's first

    def summary(self) -> dict[str, float]:
        ms = lambda xs, q: percentile(xs, q) * 1e3
        return {"seconds": self.seconds,
                "output_tokens_per_s": self.output_tokens / self.seconds,
                "total_tokens_per_s": self.total_tokens / self.seconds,
                "ttft_p50_ms": ms(self.ttft_s, 50), "ttft_p99_ms": ms(self.ttft_s, 99),
                "itl_p50_ms": ms(self.itl_s, 50), "itl_p99_ms": ms(self.itl_s, 99)}


def run_engine(engine: LLMEngine, reqs: list[BenchRequest], tag: str = "offline"
               ) -> OfflineResult:
    """Every request at once through engine.step(), greedy with ignore_eos; RuntimeError if
    a request's output is not exactly its length. A request's output comes at its end only
    (FINAL_ONLY, what `LLM.generate` and vLLM's offline benchmark ask), and its latencies are
    the engine's own observations (metrics/stats.RequestTimings, what the server's metrics
    report): TTFT from its arrival to its first token, and one inter-token latency per step
    that gave it tokens, one token a step here (no drafts)."""
    ids = [f"{tag}-{i}" for i in range(len(reqs))]
    timings = RequestTimings()
    replaced, engine.outputs.timings = engine.outputs.timings, timings
    ttft: list[float] = []
    itl: list[float] = []
    produced: dict[str, int] = {}
    start = time.perf_counter()
    try:
        for rid, r in zip(ids, reqs, strict=True):
            engine.add_request(rid, r.prompt_token_ids,
                               SamplingParams(temperature=0, max_tokens=r.output_len,
                                              ignore_eos=True,
                                              output_kind=RequestOutputKind.FINAL_ONLY))
        while engine.has_unfinished_requests():
            for out in engine.step():
                produced[out.request_id] = len(out.outputs[0].token_ids) if out.outputs else 0
            step = timings.take()
            ttft += step.ttft
            itl += step.inter_token
    finally:
        engine.outputs.timings = replaced
    seconds = time.perf_counter() - start
    for rid, r in zip(ids, reqs, strict=True):
        if produced.get(rid) != r.output_len:
            raise RuntimeError(f"{rid} produced {produced.get(rid)} tokens, not {r.output_len}")
    out_tokens = sum(r.output_len for r in reqs)
    return OfflineResult(seconds, out_tokens,
                         out_tokens + sum(len(r.prompt_token_ids) for r in reqs), ttft, itl)


@torch.inference_mode()
def run_hf_static(model: torch.nn.Module, reqs: list[BenchRequest], batch_size: int,
                  pad_id: int = 0) -> OfflineResult:
    """Hugging Face `generate` in static batches of batch_size requests in order, left-padded,
    each generating until its longest request is done (min_new_tokens = max_new_tokens, as
    ignore_eos); only the requested tokens count. A batch's first token comes at the end of its
    prefill (a streamer times it); its ITL is the batch's decode time over its steps."""
    from transformers.generation.streamers import BaseStreamer

    class FirstToken(BaseStreamer):
        def __init__(self) -> None:
            self.calls = 0
            self.first: float | None = None

        def put(self, value: torch.Tensor) -> None:
            self.calls += 1  # the first put is the prompt, the second the first new token
            if self.calls == 2:
                self.first = time.perf_counter()

        def end(self) -> None:
            pass

    device = next(model.parameters()).device
    ttft: list[float] = []
    itl: list[float] = []
    start = time.perf_counter()
    for i in range(0, len(reqs), batch_size):
        batch = reqs[i:i + batch_size]
        width = max(len(r.prompt_token_ids) for r in batch)
        ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for j, r in enumerate(batch):  # left padding
            ids[j, width - len(r.prompt_token_ids):] = torch.tensor(r.prompt_token_ids)
            mask[j, width - len(r.prompt_token_ids):] = 1
        new = max(r.output_len for r in batch)
        streamer = FirstToken()
        model.generate(input_ids=ids.to(device), attention_mask=mask.to(device),
                       max_new_tokens=new, min_new_tokens=new, do_sample=False,
                       pad_token_id=pad_id, streamer=streamer)
        if device.type == "cuda":
            torch.cuda.synchronize()
        done = time.perf_counter()
        first = streamer.first or done
        ttft.extend([first - start] * len(batch))
        for r in batch:
            itl.extend([(done - first) / max(1, new - 1)] * (r.output_len - 1))
    seconds = time.perf_counter() - start
    out_tokens = sum(r.output_len for r in reqs)
    return OfflineResult(seconds, out_tokens,
                         out_tokens + sum(len(r.prompt_token_ids) for r in reqs), ttft, itl)
