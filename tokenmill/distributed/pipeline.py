"""Pipeline stage boundaries: what one stage hands the next each step.

Invariant: every step, each stage but the last sends exactly one message to the next stage
(the rank with the same tp_rank) and each stage but the first receives exactly one, whatever
happened locally: a stage that failed sends a failure flag instead of hidden states, and the
stage after it fails the step with `PeerFailed` (the executor reports the stage that failed
first, executor/base.driver_output), so no rank waits for a tensor that never comes and
the next step's messages stay paired. A step with no tokens sends nothing (both sides know).

The message is one tensor of T * H + 1 values in the model's dtype: hidden + residual (T, H),
then the flag (1 ok, 0 failed). The sum is what the next layer's first op (add + RMSNorm)
computes first itself, so handing over the sum with no residual is the same arithmetic as the
unsplit model, at half the bytes (models/llama.py).
"""

from __future__ import annotations

import torch

from tokenmill.distributed.parallel_state import ParallelState


def send_to_next_stage(ps: ParallelState, hidden: torch.Tensor | None, num_tokens: int,
                       hidden_size: int, dtype: torch.dtype, device: torch.device) -> None:
    """hidden (T, H) to the next stage, or None: this stage failed the step."""
    if num_tokens == 0:
        return
    msg = torch.zeros(num_tokens * hidden_size + 1, dtype=dtype, device=device)
    if hidden is not None:
        msg[:-1] = hidden.reshape(-1)
        msg[-1] = 1
    torch.distributed.send(msg, dst=ps.rank + ps.tp_size)


def recv_from_prev_stage(ps: ParallelState, num_tokens: int, hidden_size: int,
                         dtype: torch.dtype, device: torch.device) -> torch.Tensor | None:
    """The previous stage's hidden states (T, H) for this step; None if it failed the step."""
    if num_tokens == 0:
        return None
    msg = torch.empty(num_tokens * hidden_size + 1, dtype=dtype, device=device)
    torch.distributed.recv(msg, src=ps.rank - ps.tp_size)
    if msg[-1].item() != 1:
        return None
    return msg[:-1].view(num_tokens, hidden_size)


class PPMissingLayer(torch.nn.Module):
    """Stands in for a module another pipeline stage holds (a decoder layer, the embedding,
    the final norm, the LM head): it has no weights, and running it is a bug."""

    def forward(self, *args: object, **kwargs: object) -> None:
        raise RuntimeError("this module lives on another pipeline stage")


def on_another_stage(model: torch.nn.Module, name: str) -> bool:
    """Whether checkpoint weight `name` belongs to a module another stage holds (the loader
    skips those and refuses any other weight it has no place for)."""
    module: torch.nn.Module = model
    for part in name.split(".")[:-1]:
        module = getattr(module, part, None)  # ModuleList children are named "0", "1", ...
        if module is None:
            return False
        if isinstance(module, PPMissingLayer):
            return True
    return False
