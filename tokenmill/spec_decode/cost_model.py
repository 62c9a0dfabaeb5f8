"""What drafting costs on this machine (policy.py SpecCosts), measured at start-up.

The scheduler's draft-length policy (policy.py) weighs the tokens a draft is expected to add
against its cost in plain decode steps: each draft token makes the verify step longer
(`verify_per_draft`), and a draft model runs one forward per draft token (`draft_forward`).
Both depend on the machine (AVX2 or AVX-512 kernels, memory bandwidth, cores), the model and
its weight format: on SmolLM2 with 2 cores a 4-token step costs 1.6-1.8x a 1-token one, and
its GGUF blocks draft at ~0.44 of a float32 step; past 4 tokens a step leaves the fused decode
call and each row costs more. So the engine times them once when it starts with speculation
on: single-sequence forward passes of 1 .. 1 + K tokens (K = num_speculative_tokens; and of
the draft model), the median of a few each after a warm-up, at the first positions of a
sequence in the null block (block 0, which no request reads): `verify_curve[k]` is a step
verifying k drafts in plain steps. Longer contexts make a verify step's attention a little
dearer than measured here.
"""

from __future__ import annotations

import statistics
import time

import torch
from torch import nn

from tokenmill.attention.base import AttentionBackend
from tokenmill.attention.input_batch import InputBatch
from tokenmill.core.interface import ScheduledRequest
from tokenmill.sampling_params import SamplingParams
from tokenmill.spec_decode.policy import SpecCosts

_WARMUP, _REPEATS = 2, 5


def time_forward(model: nn.Module, backend: AttentionBackend, block_size: int,
                 device: torch.device, num_tokens: int) -> float:
    """Median seconds of one single-sequence forward of `num_tokens` tokens plus the logits
    of its last token (what a decode step computes), in the null block."""
    row = ScheduledRequest("cost", [0] * num_tokens, 0, [0], True, SamplingParams())
    batch = InputBatch.build([row], block_size, device)
    times = []
    with torch.inference_mode():
        for i in range(_WARMUP + _REPEATS):
            start = time.perf_counter()
            hidden = model(batch.input_ids, batch.positions, backend.build_metadata(batch))
            model.compute_logits(hidden, batch.logits_indices)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            if i >= _WARMUP:
                times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure_spec_costs(model: nn.Module, backend: AttentionBackend, block_size: int,
                       device: torch.device, max_drafts: int,
                       draft_model: nn.Module | None = None) -> SpecCosts:
    """Time a plain step, verify steps of 1 + k tokens for k = 1 .. max_drafts and a draft
    forward; verify_per_draft is the mean extra cost per draft of the largest step."""
    plain = time_forward(model, backend, block_size, device, 1)
    curve = [1.0] + [max(1.0, time_forward(model, backend, block_size, device, 1 + k) / plain)
                     for k in range(1, max_drafts + 1)]
    draft = (0.0 if draft_model is None else
             time_forward(draft_model, backend, block_size, device, 1) / plain)
    return SpecCosts(verify_per_draft=(curve[-1] - 1) / max_drafts, draft_forward=draft,
                     verify_curve=tuple(curve))
