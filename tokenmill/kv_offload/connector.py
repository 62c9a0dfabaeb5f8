"""The KV connector interface: blocks by key, in a store below host memory (the disk tier) or
shared with other instances (disaggregated prefill's transfer). Two halves, as vLLM's
connectors have a scheduler role and a worker role:

- `BlockLookup` (the scheduler's, pure Python): `contains(key)`, cheap and without reading the
  block, asked while admitting a request;
- `BlockStore` (the runner's, kv_offload/block_store.py): `read(key)` → the checked block or
  None, `write(key, block)`, `close()`.

A read that fails its check, or a block gone between lookup and read, is reported and the
block computed (manager.py), so `contains` may be wrong in either direction at no cost but
time. This module's one implementation is files in a directory (block_file.py), for the disk
tier and for vLLM's SharedStorageConnector. A network transport (TCP, NIXL, Mooncake) is one
more pair: a lookup that asks the remote side (or a key index it publishes) which keys it
holds, and a store whose read receives the block into the staging slot; nothing else changes
(docs/kv_tiers.md).
"""

from __future__ import annotations

from abc import ABC, abstractmethod

from tokenmill.kv_offload.block_paths import block_exists
from tokenmill.kv_offload.config import KVTransferConfig


class BlockLookup(ABC):
    name: str  # the tier's name in metrics: "disk", "shared"

    @abstractmethod
    def contains(self, key: bytes) -> bool:
        """Whether the store seems to hold `key` (a read may still fail its check)."""


class DirectoryLookup(BlockLookup):
    """Block files in a directory (block_paths.py)."""

    def __init__(self, name: str, directory: str) -> None:
        self.name = name
        self.directory = directory

    def contains(self, key: bytes) -> bool:
        return block_exists(self.directory, key)


def connector_lookup(transfer: KVTransferConfig) -> BlockLookup:
    """The scheduler's half of a `--kv-transfer-config` connector."""
    if transfer.kv_connector == "SharedStorageConnector":
        return DirectoryLookup("shared", transfer.shared_storage_path)
    raise ValueError(f"unknown kv_connector {transfer.kv_connector!r}")
