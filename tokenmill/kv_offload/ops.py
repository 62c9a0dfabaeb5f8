"""What a step asks the runner to do with offloaded KV, and what the runner reports back.

The runner does them in this order, around the step's other block operations:
`save_host` and `save_files` (blocks evicted this step: copied out before the step's writes
reuse them), swaps and copy-on-write, `prefetch` (block files read into host slots, checked),
`load` (host slots into the blocks of this step's cache hits), the forward pass, then
`publish` (a producer's newly computed prompt blocks written to the shared directory before the
step returns, so its answer means the KV is there).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class OffloadOps:
    save_host: list[tuple[int, int]] = field(default_factory=list)  # (block, host slot)
    save_files: list[tuple[int, bytes]] = field(default_factory=list)  # (block, key): disk tier
    prefetch: list[tuple[bytes, int]] = field(default_factory=list)  # (key, host slot)
    load: list[tuple[int, int]] = field(default_factory=list)  # (host slot, block)
    publish: list[tuple[int, bytes]] = field(default_factory=list)  # (block, key): shared dir

    def __bool__(self) -> bool:
        return bool(self.save_host or self.save_files or self.prefetch or self.load
                    or self.publish)


@dataclass
class OffloadResult:
    prefetched: dict[bytes, bool] = field(default_factory=dict)  # key → read and checked
    bytes_saved: dict[str, int] = field(default_factory=dict)  # file tier → bytes written
    disk_available: bool = True  # False once a write failed (a full disk): no more writes
