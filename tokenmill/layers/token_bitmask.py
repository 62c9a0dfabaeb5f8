"""Applying grammar token bitmasks to logits (structured outputs), in place, on any device.

A bitmask row has W = ceil(V / 32) int32 words; bit j of word i allows token 32 i + j (the
layout llguidance and xgrammar fill). Disallowed tokens get -inf before anything else touches
the logits (bias, penalties, sampling, logprobs: as in vLLM, a constrained request's logprobs
are those of the masked distribution). On CPU in float32 the C++ op (csrc/cpu_ops.h, ~10x
faster); elsewhere plain tensor ops, which the op is tested against. Neither needs
torch.compile, which the grammar libraries' own helpers use on CPU.
"""

from __future__ import annotations

import torch

from tokenmill.layers import cpu_ops

_SHIFTS = torch.arange(32, dtype=torch.int32)  # (32,)


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """(R, W) int32 → (R, vocab_size) bool: which tokens each row allows."""
    shifts = _SHIFTS.to(bitmask.device)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1  # (R, W, 32)
    return bits.view(bitmask.shape[0], -1)[:, :vocab_size].bool()


def apply_token_bitmask_(logits: torch.Tensor, bitmask: torch.Tensor,
                         rows: torch.Tensor) -> torch.Tensor:
    """Mask rows `rows` (R,) of logits (S, V) with bitmask (R, W), in place; returns logits."""
    if bitmask.shape[-1] * 32 < logits.shape[-1]:
        raise ValueError(f"bitmask of {bitmask.shape[-1]} words cannot cover "
                         f"{logits.shape[-1]} logits")
    if (cpu_ops.fused(logits) and logits.is_contiguous()
            and cpu_ops.apply_token_bitmask_(logits, bitmask.contiguous(), rows)):
        return logits
    allowed = unpack_bitmask(bitmask.to(logits.device, non_blocking=True), logits.shape[-1])
    sub = logits.index_select(0, rows).masked_fill_(~allowed, float("-inf"))  # (R, V)
    return logits.index_copy_(0, rows, sub)
