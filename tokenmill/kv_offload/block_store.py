"""BlockStore: the runner's half of the KV connector interface (kv_offload/connector.py has
the scheduler's half and the contract): read a block by key, checked, or None; write one;
close. Files in a directory are file_store.py's FileStore (the disk tier, the shared storage
connector)."""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch


class BlockStore(ABC):
    name: str  # the tier's name in metrics: "disk", "shared"

    @abstractmethod
    def read(self, key: bytes) -> torch.Tensor | None:
        """The block stored under `key` if it is exactly that block (checked), else None."""

    @abstractmethod
    def write(self, key: bytes, block: torch.Tensor) -> bool:
        """Store a block (a CPU tensor) before returning; False if it failed."""

    def write_async(self, key: bytes, block: torch.Tensor) -> None:
        """Store a block (a private copy) when convenient; by default, now."""
        self.write(key, block)

    def take_bytes_written(self) -> int:
        """Bytes stored since the last call (metrics)."""
        return 0

    def close(self) -> None:  # noqa: B027 (a store with nothing queued has nothing to do)
        """Finish what was queued."""

