"""The runner's share of embedding requests (pooling_params.py): each step, per request whose
step has `pooling`, what its positions contribute to the embedding, taken from the final
hidden states (after the model's last norm, where transformers' `last_hidden_state` is).

MEAN: the sum of the step's positions' hidden states and their count; LAST: the last prompt
position's hidden state, in the step that computes it. The engine adds the partial sums up
(engine/pooled_outputs.py); sums are float32 whatever the model's dtype.
"""

from __future__ import annotations

import torch

from tokenmill.attention.input_batch import InputBatch
from tokenmill.core.interface import ScheduledRequest


def pool_step(reqs: list[ScheduledRequest], batch: InputBatch, hidden: torch.Tensor
              ) -> dict[str, tuple[int, int, torch.Tensor]]:
    """hidden (T, H) → req_id → (first position, number of positions, (H,) float32 on CPU)."""
    out: dict[str, tuple[int, int, torch.Tensor]] = {}
    for i, r in enumerate(reqs):
        if r.pooling is None:
            continue
        first, n = batch.query_start_locs[i], len(r.token_ids)
        rows = hidden[first:first + n]  # (n, H)
        if r.pooling == "MEAN":
            out[r.req_id] = (r.start_pos, n, rows.float().sum(0).cpu())
        elif r.start_pos + n == len(r.prompt_token_ids):  # LAST: the step reaching the end
            out[r.req_id] = (r.start_pos + n - 1, 1, rows[-1].float().cpu())
    return out
