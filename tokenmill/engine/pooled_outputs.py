"""The engine's side of embedding requests: the runner's per-step partial poolings
(worker/pooler.py) added up into one vector per request, then truncated to the requested
`dimensions` and L2-normalized where asked (pooling_params.py).

Invariant: a request's steps cover its prompt positions in order from 0; a step from position
0 again (recomputed after preemption) starts the sum afresh, and a re-executed step (after a
failed one) replaces its own earlier part, so every position counts exactly once.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tokenmill.core.request import Request
from tokenmill.outputs import EmbeddingOutput, EmbeddingRequestOutput


class PooledState:
    def __init__(self, request: Request) -> None:
        self.request = request
        self.request_id, self.prompt_token_ids = request.request_id, request.prompt_token_ids
        self.params = request.pooling_params  # resolved: pooling_type and normalize set
        self.parts: dict[int, tuple[int, torch.Tensor]] = {}  # first position → (n, sum)

    def add(self, first: int, n: int, vector: torch.Tensor) -> None:
        if first == 0:
            self.parts.clear()
        self.parts[first] = (n, vector)

    def embedding(self) -> torch.Tensor:
        """The request's embedding (dimensions,) float32, once its prompt is computed."""
        num = len(self.prompt_token_ids)
        if self.params.pooling_type == "MEAN":
            covered = sum(n for n, _ in self.parts.values())
            if covered != num:
                raise RuntimeError(f"request {self.request_id}: pooled {covered} of {num} "
                                   "prompt positions")
            vector = torch.stack([v for _, v in self.parts.values()]).sum(0) / num
        else:
            vector = self.parts[num - 1][1]
        if self.params.dimensions is not None:
            vector = vector[:self.params.dimensions]
        return F.normalize(vector, dim=-1) if self.params.normalize else vector

    def output(self, error: str | None = None) -> EmbeddingRequestOutput:
        values = [] if error is not None else self.embedding().tolist()
        return EmbeddingRequestOutput(
            self.request_id, self.prompt_token_ids, EmbeddingOutput(values), finished=True,
            error=error, metrics={"arrival_time": self.request.arrival_time,
                                  "first_scheduled_time": self.request.first_scheduled_time})
