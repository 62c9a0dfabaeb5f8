"""Vocabulary-parallel embedding and LM head.

Each rank holds rows [rank * V/tp, (rank+1) * V/tp) of the table. The embedding zeroes ids
outside its shard and all-reduces; the head computes logits for its shard and all-gathers.
`compute_logits` takes explicit `logits_indices`: only the positions that sample pay for the
vocab-sized GEMM.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.distributed import ParallelState
from tokenmill.layers import cpu_ops
from tokenmill.layers.cpu_gemm import packed_linear, prepack
from tokenmill.utils import cdiv


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int,
                 tp: ParallelState = ParallelState()) -> None:
        super().__init__()
        self.tp = tp
        self.vocab_size = vocab_size
        self.shard_size = cdiv(vocab_size, tp.tp_size)
        self.start = tp.tp_rank * self.shard_size
        self.weight = nn.Parameter(torch.empty(self.shard_size, hidden_size), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor,
                      shard_id: int | str | None = None) -> None:
        if loaded.shape[1] != param.shape[1] or loaded.shape[0] != self.vocab_size:
            raise ValueError(f"embedding shape mismatch: checkpoint {tuple(loaded.shape)}, "
                             f"model ({self.vocab_size}, {param.shape[1]})")
        shard = loaded[self.start:self.start + self.shard_size]
        param.data.zero_()
        param.data[:shard.shape[0]].copy_(shard)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.start
        valid = (local >= 0) & (local < self.shard_size)
        out = F.embedding(local.clamp(0, self.shard_size - 1), self.weight)
        return self.tp.all_reduce(out * valid.unsqueeze(-1))


class ParallelLMHead(VocabParallelEmbedding):
    packed_weight: torch.Tensor | None = None
    tied = False  # set by the model when the head shares the input embedding's table

    def prepack(self) -> None:
        """Add a oneDNN-packed copy for the logits GEMM. The dense table stays when the head
        is tied (it is also the input embedding) or the small-M kernel reads it (decode)."""
        if self.packed_weight is None:
            self.packed_weight = prepack(self.weight)
            if not self.tied and not cpu_ops.ops_available():
                del self.weight

    def compute_logits(self, hidden: torch.Tensor, logits_indices: torch.Tensor) -> torch.Tensor:
        """hidden (T, H), logits_indices (S,) → logits (S, vocab_size)."""
        selected = hidden[logits_indices]  # (S, H)
        weight = getattr(self, "weight", None)  # None once prepack() freed it
        if cpu_ops.takes_small_m(selected, weight):
            logits = cpu_ops.linear_small_m(selected, weight)  # (S, V / tp)
        elif self.packed_weight is not None:
            logits = packed_linear(selected, self.packed_weight)  # (S, V / tp)
        else:
            logits = F.linear(selected, self.weight)
        logits = self.tp.all_gather_last_dim(logits)
        return logits[:, :self.vocab_size]
