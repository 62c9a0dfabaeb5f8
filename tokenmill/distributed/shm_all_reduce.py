"""ShmAllReduce: the tensor-parallel all-reduce between the ranks of one machine over shared
memory (the C++ op in csrc/shm_all_reduce.h; protocol and layout there), instead of gloo's
loopback TCP: benchmarks/parallel.py measures both.

The executor creates the segment (`create_segment`: a zero-filled file under /dev/shm) and
removes it at shutdown; each worker maps it (`ShmAllReduce(path, rank, world)`). Every rank
makes the same calls in the same order (the model's layers do), so their sequence numbers agree.
A float32 CPU tensor goes through the segment; anything else (another dtype, no C++ kernels)
through torch.distributed, which every rank decides alike.

TOKENMILL_SHM_ALL_REDUCE=0 turns it off (gloo for everything: for comparisons).
"""

from __future__ import annotations

import os
import tempfile
from typing import Any

import torch

SLOT_BYTES = 4 << 20  # per rank and buffer; a larger tensor goes in slot-sized chunks
TIMEOUT_S = 120.0  # a peer that does not arrive by then is dead or out of step


def segment_bytes(world_size: int, slot_bytes: int = SLOT_BYTES) -> int:
    return 64 * world_size + 2 * world_size * slot_bytes


def enabled() -> bool:
    return os.environ.get("TOKENMILL_SHM_ALL_REDUCE", "1") != "0"


def create_segment(world_size: int, slot_bytes: int = SLOT_BYTES) -> str:
    """A zero-filled shared file for `world_size` ranks; the caller removes it."""
    folder = "/dev/shm" if os.path.isdir("/dev/shm") else None
    fd, path = tempfile.mkstemp(prefix="tokenmill-allreduce-", dir=folder)
    os.ftruncate(fd, segment_bytes(world_size, slot_bytes))
    os.close(fd)
    return path


class ShmAllReduce:
    def __init__(self, path: str, rank: int, world_size: int,
                 slot_bytes: int = SLOT_BYTES, group: Any = None) -> None:
        # rank / world_size within the group sharing the segment (one pipeline stage's
        # tensor-parallel ranks); `group`: their torch.distributed group, for the fallback
        self.rank, self.world_size, self.slot_bytes = rank, world_size, slot_bytes
        self.group = group
        self.segment = torch.from_file(path, shared=True, size=segment_bytes(world_size,
                                                                             slot_bytes),
                                       dtype=torch.uint8)
        self.seq = 0  # the last sequence number used (the same on every rank)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """x summed over the ranks, in place (every rank gets the same bits)."""
        from tokenmill.layers import cpu_ops

        if not cpu_ops.fused(x):  # float32 on CPU with the kernels built, alike on every rank
            torch.distributed.all_reduce(x, group=self.group)
            return x
        y = x if x.is_contiguous() else x.contiguous()
        self.seq = cpu_ops.shm_all_reduce_(y, self.segment, self.rank, self.world_size,
                                           self.slot_bytes, self.seq, TIMEOUT_S)
        if y is not x:
            x.copy_(y)
        return x

    def kernel_args(self) -> tuple[torch.Tensor, int, int, int, float]:
        """What the fused C++ decode call needs to all-reduce between layers itself."""
        return self.segment, self.rank, self.world_size, self.slot_bytes, TIMEOUT_S
