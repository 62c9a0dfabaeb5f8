"""The KV cache's size on CUDA from a profiled step (vLLM's --gpu-memory-utilization).

With the weights loaded, the runner runs the largest step the scheduler may send
(`profile_requests`: max_num_batched_tokens tokens over up to max_num_seqs sequences, one long
prefill and single tokens, every sequence sampled through top-k and top-p) on a small KV cache
of its own, and measures the step's activation peak. The KV cache then takes what is left of
`gpu_memory_utilization` x the device's memory:

    kv bytes = utilization * total - in use after the step - the step's activation peak

where "in use" is everything the device reports used once the allocator's cache is emptied:
the weights, the CUDA context and libraries' workspaces, and other processes on the device (as
vLLM's v0 counted them: a second engine on the same GPU gets what the first left of its share).
Never more than the longest possible batch needs (max_num_seqs x max_model_len tokens, as on
CPU): a small model with a short context takes what it can use, not 90% of an H100. CUDA
graphs are captured later, from the headroom `1 - utilization` leaves.

Invariants: the profiled step reads and writes only its own cache (freed before the real one
is allocated); its requests are seeded and forgotten, so they leave the sampler's generators as
they were; a budget that leaves no room for a KV cache fails start-up with the figures that
explain it. kv_cache_memory / num_kv_blocks, when set, skip the profile (and on CPU the budget
is worker/kv_budget.py's).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from tokenmill.attention.input_batch import InputBatch
from tokenmill.config import EngineConfig
from tokenmill.core.interface import ScheduledRequest
from tokenmill.sampling_params import SamplingParams
from tokenmill.utils import cdiv
from tokenmill.worker.kv_budget import longest_batch_bytes

if TYPE_CHECKING:
    from tokenmill.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)

GiB = 2**30


@dataclass(frozen=True)
class MemoryProfile:
    total: int  # the device's bytes
    in_use: int  # bytes in use on the device after the profiled step, caches emptied
    activation_peak: int  # the step's peak allocation beyond what stayed allocated

    def kv_budget(self, utilization: float) -> int:
        """Bytes the KV cache may take (negative: none fit; module doc)."""
        return int(self.total * utilization) - self.in_use - self.activation_peak


def profile_requests(config: EngineConfig, block_size: int) -> list[ScheduledRequest]:
    """The largest step: T = max_num_batched_tokens tokens (which the config keeps >= the
    longest prompt when prefill is not chunked) over S = min(max_num_seqs, T) sequences, each
    at least one token and at most max_model_len, the tokens beyond S given to the first
    sequences (one long prefill, then single tokens, as a full step mixes them), all sampling
    with temperature, top-k and top-p; each sequence's blocks consecutive from block 1 (block
    0 is the null block)."""
    sched, max_len = config.scheduler, config.model.max_model_len
    tokens = sched.max_num_batched_tokens
    seqs = min(sched.max_num_seqs, tokens)
    lengths, extra = [1] * seqs, tokens - seqs
    for i in range(seqs):
        more = min(extra, max_len - 1)
        lengths[i] += more
        extra -= more
    # seeded: the profile draws from generators of its own, not the engine's
    params = SamplingParams(temperature=0.8, top_k=50, top_p=0.9, max_tokens=1, seed=0)
    reqs, next_block = [], 1
    for i, n in enumerate(lengths):
        blocks = list(range(next_block, next_block + cdiv(n, block_size)))
        next_block += len(blocks)
        reqs.append(ScheduledRequest(req_id=f"memory-profile-{i}", token_ids=[0] * n,
                                     start_pos=0, block_ids=blocks, sample=True,
                                     sampling_params=params, prompt_token_ids=[0] * n))
    return reqs


@torch.inference_mode()
def run_profile_step(runner: ModelRunner, reqs: list[ScheduledRequest]) -> None:
    """The step's forward pass, logits and sampling, as `ModelRunner._execute` runs them, on the
    KV cache bound to the layers (which must hold the requests' blocks)."""
    batch = InputBatch.build(reqs, runner.block_size, runner.device)
    meta = runner.backend.build_metadata(batch)
    hidden_in = None
    if not runner.ps.is_first_stage:  # what the previous stage would send
        hidden_in = torch.zeros(batch.num_tokens, runner.config.model.hf_config.hidden_size,
                                dtype=runner.config.model.dtype, device=runner.device)
    hidden = runner._forward(reqs, batch, meta, hidden_in)
    if runner.ps.is_last_stage:
        logits = runner.model.compute_logits(hidden, batch.logits_indices)  # (S, V)
        if runner.is_driver:
            runner.sampler(logits, reqs)
            runner.sampler.forget({r.req_id for r in reqs})


def profiled_kv_budget(runner: ModelRunner, block_bytes: int) -> int | None:
    """CUDA without a configured size: the KV cache's bytes from a profiled step (module doc),
    at most what the longest batch of `block_bytes` blocks needs; the profile is kept as
    runner.memory_profile. None elsewhere (kv_budget.py sizes it). ValueError when nothing is
    left for it."""
    config, cache = runner.config, runner.config.cache
    if (runner.device.type != "cuda" or cache.kv_cache_memory is not None
            or cache.num_kv_blocks is not None):
        return None
    reqs = profile_requests(config, runner.block_size)
    profile = runner.memory_profile = _measure(runner, reqs)
    budget = profile.kv_budget(cache.gpu_memory_utilization)
    summary = (f"gpu_memory_utilization={cache.gpu_memory_utilization} of "
               f"{profile.total / GiB:.2f} GiB; in use after the weights and the profiled "
               f"step of {sum(r.num_tokens for r in reqs)} tokens over {len(reqs)} sequences: "
               f"{profile.in_use / GiB:.2f} GiB, its activation peak "
               f"{profile.activation_peak / GiB:.2f} GiB")
    if budget <= 0:
        raise ValueError(f"no memory is left for the KV cache: {summary}. Raise "
                         "gpu_memory_utilization, lower max_num_batched_tokens / max_num_seqs, "
                         "or free the device")
    needed = longest_batch_bytes(config, block_bytes)
    logger.info("KV cache budget %.2f GiB: %s%s", min(budget, needed) / GiB, summary,
                f"; capped at what {config.scheduler.max_num_seqs} sequences of "
                f"{config.model.max_model_len} tokens need" if needed < budget else "")
    return min(budget, needed)


def _measure(runner: ModelRunner, reqs: list[ScheduledRequest]) -> MemoryProfile:
    """Run the step on a KV cache of its own and measure the device (caches emptied)."""
    with profile_cache(runner, 1 + sum(len(r.block_ids) for r in reqs)):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        run_profile_step(runner, reqs)
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - before
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info()
    return MemoryProfile(total=total, in_use=total - free, activation_peak=peak)


@contextlib.contextmanager
def profile_cache(runner: ModelRunner, num_blocks: int) -> Iterator[None]:
    """A KV cache of num_blocks bound to the layers for the profiled step; on exit the runner's
    own (None at start-up) bound again."""
    own = tuple(getattr(runner, name, None) for name in ("kv_cache", "kv_scales",
                                                         "key_rotation"))
    runner.kv_cache, runner.kv_scales, runner.key_rotation = runner.kv_tensors(num_blocks)
    try:
        runner._bind_attention()
        yield
    finally:
        runner.kv_cache, runner.kv_scales, runner.key_rotation = own
        if runner.kv_cache is not None:
            runner._bind_attention()
        else:
            for attn in runner.model.attention_layers():
                attn.kv_cache = None
