"""KVOffloadConfig: where KV blocks go below the KV cache (vLLM's `--kv-offloading-*` flags and
`--kv-transfer-config`), as data.

- `host_blocks` > 0: a CPU-memory tier of that many blocks (`--kv-offloading-backend native`,
  `--kv-offloading-size GiB`). Full blocks evicted from the prefix cache are copied there.
- `disk_dir`: a directory of block files (`--kv-offloading-backend disk --kv-offloading-dir`),
  bounded by `disk_bytes` (LRU), written on eviction off the step's critical path; it outlives
  the process.
- `shared_dir` with a role (`--kv-transfer-config`, vLLM's SharedStorageConnector): a producer
  writes every full prompt block it computes there before the step returns; a consumer reads
  what it finds. Unbounded (vLLM's connector does not bound it either).

Files are read back through a small host staging pool (`staging_blocks`), so a block read from
a file is checked (kv_offload/block_file.py) before any request is given it.
`identity` names the model's KV (weights, dtype, KV format, block size, tensor split): it seeds
every block's key, so another model or format never finds these blocks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tokenmill.utils.json_option import json_object
from tokenmill.utils.sizes import parse_size

OFFLOADING_BACKENDS = ("native", "disk")
KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")
KV_CONNECTORS = ("SharedStorageConnector",)


@dataclass(frozen=True)
class KVTransferConfig:
    """vLLM's `--kv-transfer-config` JSON, the fields this connector reads."""

    kv_connector: str
    kv_role: str
    shared_storage_path: str

    @property
    def produces(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def consumes(self) -> bool:
        return self.kv_role in ("kv_consumer", "kv_both")

    @staticmethod
    def parse(value: str | dict[str, Any] | KVTransferConfig | None) -> KVTransferConfig | None:
        if value is None or isinstance(value, KVTransferConfig):
            return value
        value = json_object(value, "kv_transfer_config")
        known = {"kv_connector", "kv_role", "kv_connector_extra_config", "kv_rank",
                 "kv_parallel_size", "engine_id"}
        unknown = set(value) - known
        if unknown:
            raise ValueError(f"kv_transfer_config: unknown field(s) {', '.join(sorted(unknown))};"
                             f" known: {', '.join(sorted(known))}")
        connector = value.get("kv_connector")
        if connector not in KV_CONNECTORS:
            raise ValueError(f"kv_transfer_config: kv_connector must be one of "
                             f"{', '.join(KV_CONNECTORS)}, got {connector!r}")
        role = value.get("kv_role")
        if role not in KV_ROLES:
            raise ValueError(f"kv_transfer_config: kv_role must be one of {', '.join(KV_ROLES)},"
                             f" got {role!r}")
        extra = value.get("kv_connector_extra_config") or {}
        path = extra.get("shared_storage_path") if isinstance(extra, dict) else None
        if not isinstance(path, str) or not path:
            raise ValueError("kv_transfer_config: SharedStorageConnector needs "
                             '"kv_connector_extra_config": {"shared_storage_path": DIR}')
        return KVTransferConfig(connector, role, path)


def parse_offloading_size(value: int | float | str) -> int:
    """Bytes from `--kv-offloading-size`: a bare number is GiB (vLLM's unit for this flag),
    a string may carry its own unit ("512MiB")."""
    if isinstance(value, int | float) and not isinstance(value, bool):
        if value <= 0:
            raise ValueError(f"kv_offloading_size must be positive, got {value!r}")
        return int(value * 2**30)
    try:
        return parse_offloading_size(float(value))
    except ValueError:
        return parse_size(value)


@dataclass(frozen=True)
class KVOffloadConfig:
    identity: str  # hex digest naming the model's KV (factory.kv_identity)
    block_bytes: int  # one block, all layers, K and V (a rank's share)
    host_blocks: int = 0
    disk_dir: str | None = None
    disk_bytes: int = 0
    transfer: KVTransferConfig | None = None
    staging_blocks: int = 0  # host blocks files are read into and checked

    def __post_init__(self) -> None:
        if self.host_blocks < 0 or self.staging_blocks < 0 or self.disk_bytes < 0:
            raise ValueError("kv offloading sizes must be >= 0")
        if self.disk_dir is not None and self.disk_bytes <= 0:
            raise ValueError("the disk tier needs a size (kv_offloading_size)")
        if self.reads_files and self.staging_blocks < 1:
            raise ValueError("reading block files needs staging blocks")

    @property
    def reads_files(self) -> bool:
        return self.disk_dir is not None or (self.transfer is not None and
                                             self.transfer.consumes)
