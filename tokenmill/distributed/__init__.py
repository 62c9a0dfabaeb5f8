"""Tensor-parallel state and collectives; everything is a no-op at world size 1."""

from tokenmill.distributed.parallel_state import ParallelState, PeerFailed

__all__ = ["ParallelState", "PeerFailed"]
