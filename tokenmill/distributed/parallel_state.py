"""ParallelState: this process's tensor-parallel rank and size, passed explicitly to layers.

Layers receive a ParallelState at construction and never read a global process group, so a
model can be built (and tested) without torch.distributed. At size 1 every collective returns
its input unchanged. `comm` is the all-reduce between ranks of one machine over shared memory
(distributed/shm_all_reduce.py), when the executor set one up; torch.distributed otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from tokenmill.distributed.shm_all_reduce import ShmAllReduce


@dataclass(frozen=True)
class ParallelState:
    tp_rank: int = 0
    tp_size: int = 1
    comm: ShmAllReduce | None = field(default=None, compare=False)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """x summed over the ranks, in place."""
        if self.tp_size == 1:
            return x
        if self.comm is not None:
            return self.comm.all_reduce(x)
        torch.distributed.all_reduce(x)
        return x

    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.tp_size)]
        torch.distributed.all_gather(parts, x.contiguous())
        return torch.cat(parts, dim=-1)
