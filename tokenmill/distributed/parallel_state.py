"""ParallelState: this process's place in the tensor- and pipeline-parallel grid, passed
explicitly to layers and models.

Layers receive a ParallelState at construction and never read a global process group, so a
model can be built (and tested) without torch.distributed. At size 1 every collective returns
its input unchanged.

Ranks are laid out stage-major (vLLM's order): global rank = pp_rank * tp_size + tp_rank. The
ranks of one pipeline stage form its tensor-parallel group (`tp_group`; None: the whole world,
when there is one stage); `comm` is that group's all-reduce over shared memory
(distributed/shm_all_reduce.py), when the executor set one up. A stage holds layers
`layer_range(num_layers)`; its boundary tensors go to the same tp_rank of the next stage
(distributed/pipeline.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from tokenmill.distributed.shm_all_reduce import ShmAllReduce


class PeerFailed(RuntimeError):
    """Another rank failed this step first (its own error is what the executor reports:
    executor/base.driver_output), and this rank cannot go on with the step without it."""


@dataclass(frozen=True)
class ParallelState:
    tp_rank: int = 0
    tp_size: int = 1
    comm: ShmAllReduce | None = field(default=None, compare=False)
    pp_rank: int = 0
    pp_size: int = 1
    tp_group: Any = field(default=None, compare=False)  # torch ProcessGroup; None: the world

    @property
    def rank(self) -> int:
        """This process's global rank."""
        return self.pp_rank * self.tp_size + self.tp_rank

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    @property
    def is_driver(self) -> bool:
        """The rank that samples: the last stage's first tensor-parallel rank."""
        return self.is_last_stage and self.tp_rank == 0

    def layer_range(self, num_layers: int) -> range:
        """The decoder layers this stage holds: contiguous, as even as the count allows (the
        earlier stages take the remainder: the last one also runs the norm and LM head)."""
        base, extra = divmod(num_layers, self.pp_size)
        start = self.pp_rank * base + min(self.pp_rank, extra)
        return range(start, start + base + (self.pp_rank < extra))

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """x summed over this stage's tensor-parallel ranks, in place."""
        if self.tp_size == 1:
            return x
        if self.comm is not None:
            return self.comm.all_reduce(x)
        torch.distributed.all_reduce(x, group=self.tp_group)
        return x

    def broadcast_from_driver(self, x: torch.Tensor) -> torch.Tensor:
        """The stage's first rank's x (int64, values in [-1, 2**24)) on every rank of the stage.
        Over shared memory it is a sum where the other ranks add zeros: exact in float32 for
        such values (token ids), and µs instead of a gloo broadcast's ~0.5 ms."""
        if self.tp_size == 1:
            return x
        if self.comm is not None:
            f = x.to(torch.float32) if self.tp_rank == 0 else torch.zeros(x.shape)
            return self.comm.all_reduce(f).to(torch.int64)
        torch.distributed.broadcast(x, src=self.rank - self.tp_rank, group=self.tp_group)
        return x

    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.tp_size)]
        torch.distributed.all_gather(parts, x.contiguous(), group=self.tp_group)
        return torch.cat(parts, dim=-1)
