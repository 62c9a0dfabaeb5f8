"""Vocabulary-parallel embedding and LM head, through the same quantization method objects as
the linear layers (a Q8_0 table is looked up and multiplied by the same kernels).

Each rank holds rows [rank * V/tp, (rank+1) * V/tp) of the table. The embedding zeroes ids
outside its shard and all-reduces; the head computes logits for its shard and all-gathers.
`compute_logits` takes explicit `logits_indices`: only the positions that sample pay for the
vocab-sized GEMM. A tied head (`tie_to`) owns no weights: it multiplies with the embedding's
table through the embedding's method, so the table exists once in whatever format it has.
"""

from __future__ import annotations

import torch
from torch import nn

from tokenmill.distributed import ParallelState
from tokenmill.layers.linear import fill_span
from tokenmill.quantization.base import QuantizationConfig
from tokenmill.quantization.unquantized import UnquantizedConfig
from tokenmill.utils import cdiv


class VocabParallelEmbedding(nn.Module):
    # False: lookups only, no GEMM reads this table (a oneDNN copy would be waste); a tied
    # LM head sets it.
    runs_gemm = False
    looks_up_rows = True

    def __init__(self, vocab_size: int, hidden_size: int, tp: ParallelState = ParallelState(),
                 quant_config: QuantizationConfig | None = None, prefix: str = "") -> None:
        super().__init__()
        self.tp = tp
        self.vocab_size = vocab_size
        self.shard_size = cdiv(vocab_size, tp.tp_size)
        self.start = tp.tp_rank * self.shard_size
        self.quant_method = (quant_config or UnquantizedConfig()).embedding_method(prefix)
        self.quant_method.create_weights(self, hidden_size, [self.shard_size],
                                         torch.get_default_dtype())
        for param in self.parameters(recurse=False):
            param.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor,
                      shard_id: int | str | None = None) -> None:
        dim = param.output_dim  # the vocabulary's dim
        if loaded.shape[dim] != self.vocab_size or \
                loaded.shape[:dim] + loaded.shape[dim + 1:] != \
                param.shape[:dim] + param.shape[dim + 1:]:
            raise ValueError(f"embedding shape mismatch: checkpoint {tuple(loaded.shape)}, "
                             f"model {tuple(param.shape)} for a vocabulary of "
                             f"{self.vocab_size}")
        shard = loaded.narrow(dim, self.start, min(self.shard_size, self.vocab_size - self.start))
        if shard.shape[dim] == self.shard_size:  # (a parameter holding its parts keeps it)
            fill_span(param, shard, dim)
            return
        param.data.zero_()  # the last rank's rows past the vocabulary
        param.data.narrow(dim, 0, shard.shape[dim]).copy_(shard)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.tp_size == 1:
            return self.quant_method.embed(self, input_ids)
        local = input_ids - self.start
        valid = (local >= 0) & (local < self.shard_size)
        out = self.quant_method.embed(self, local.clamp(0, self.shard_size - 1))
        return self.tp.all_reduce(out * valid.unsqueeze(-1))


class ParallelLMHead(VocabParallelEmbedding):
    runs_gemm = True
    looks_up_rows = False

    def __init__(self, vocab_size: int, hidden_size: int, tp: ParallelState = ParallelState(),
                 quant_config: QuantizationConfig | None = None, prefix: str = "") -> None:
        super().__init__(vocab_size, hidden_size, tp, quant_config, prefix)
        self.tied_to: VocabParallelEmbedding | None = None

    def tie_to(self, embedding: VocabParallelEmbedding) -> None:
        """Share `embedding`'s table: this head's own parameters are dropped."""
        for name in list(self._parameters):
            del self._parameters[name]
        self.tied_to = embedding
        embedding.runs_gemm = True

    @property
    def weight_owner(self) -> nn.Module:
        """The module whose parameters and method hold the table."""
        return self.tied_to if self.tied_to is not None else self

    def compute_logits(self, hidden: torch.Tensor, logits_indices: torch.Tensor) -> torch.Tensor:
        """hidden (T, H), logits_indices (S,) → logits (S, vocab_size)."""
        selected = hidden[logits_indices]  # (S, H)
        owner = self.weight_owner
        logits = owner.quant_method.apply(owner, selected)  # (S, V / tp)
        logits = self.tp.all_gather_last_dim(logits)
        return logits[:, :self.vocab_size]
