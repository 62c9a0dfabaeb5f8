"""OffloadManager: the scheduler's side of the KV tiers below the cache (kv_offload/config.py).
KVCacheManager calls it; it decides, the runner copies (kv_offload/worker.py, ops.py).

- Eviction: a full block the prefix cache evicts is saved under its key (block_hash.py) to
  the host tier (native) or the disk tier, unless that tier holds it already. Not while the
  prefix cache is suspended (a failed step may have left blocks unwritten).
- Lookup: after the radix tree's hit, the request's next blocks are looked up by key in host
  memory (the host tier, then the staging slots of blocks read from files); a run of hits
  becomes cache blocks filled by `load` copies before the step's forward pass.
- Files: where the run of host hits stops and files (the disk tier, a producer's shared
  directory) hold the next blocks, the request waits one step while the runner reads them
  into staging slots and checks them; then they are host hits, pinned for the request until
  it loads them or ends. A block whose file failed its check is not read again.
- Publish (a kv_producer): every full prompt block is written to the shared directory after
  the step that computes it, unless a file is there already.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from tokenmill.kv_offload.block_hash import block_keys, chain_seed
from tokenmill.kv_offload.config import KVOffloadConfig
from tokenmill.kv_offload.connector import BlockLookup, DirectoryLookup, connector_lookup
from tokenmill.kv_offload.host_index import HostIndex
from tokenmill.kv_offload.ops import OffloadOps, OffloadResult


@dataclass
class OffloadHit:
    slots: list[int]  # host slots of the request's next blocks, in order
    tiers: list[str]  # where each came from


class OffloadManager:
    def __init__(self, config: KVOffloadConfig, block_size: int) -> None:
        self.config = config
        self.block_size = block_size
        self.host = HostIndex(config.host_blocks)
        self.staging = HostIndex(config.staging_blocks, first_slot=config.host_blocks)
        self._staged_tier: dict[bytes, str] = {}
        self._keys: dict[str, list[bytes]] = {}  # request id → keys of its blocks so far
        self._seeds: dict[str | None, bytes] = {}
        # request id → (key, staging slot) of the blocks read for it, pinned for it
        self._staged_for: dict[str, list[tuple[bytes, int]]] = {}
        self._bad: set[bytes] = set()  # keys whose file failed its check
        self._ops = OffloadOps()
        self._load_pins: list[int] = []
        self.disk = None if config.disk_dir is None else DirectoryLookup("disk", config.disk_dir)
        transfer = config.transfer
        self.shared = None if transfer is None else connector_lookup(transfer)
        self.disk_available = self.disk is not None
        # counters (metrics), per tier (cpu, disk, shared): blocks, bytes (a file's as
        # written), prompt tokens found
        self.blocks_saved: dict[str, int] = defaultdict(int)
        self.blocks_loaded: dict[str, int] = defaultdict(int)
        self.bytes_saved: dict[str, int] = defaultdict(int)
        self.bytes_loaded: dict[str, int] = defaultdict(int)
        self.hit_tokens: dict[str, int] = defaultdict(int)

    # ---- keys -------------------------------------------------------------------------------
    def seed(self, namespace: str | None) -> bytes:
        if namespace not in self._seeds:
            self._seeds[namespace] = chain_seed(self.config.identity, namespace)
        return self._seeds[namespace]

    def keys(self, request_id: str, token_ids: list[int], namespace: str | None,
             num_blocks: int) -> list[bytes]:
        """Keys of a request's first `num_blocks` blocks (extended as it grows)."""
        keys = self._keys.setdefault(request_id, [])
        if len(keys) < num_blocks:
            keys += block_keys(self.seed(namespace), token_ids[:num_blocks * self.block_size],
                               self.block_size, len(keys), keys[-1] if keys else None)
        return keys[:num_blocks]

    def path_keys(self, token_ids: list[int], namespace: str | None) -> list[bytes]:
        """Keys of every whole block of a token path from the start (a tree node's)."""
        return block_keys(self.seed(namespace), token_ids, self.block_size)

    def forget(self, request_id: str) -> None:
        self._keys.pop(request_id, None)
        self._release_staged(request_id)

    def _release_staged(self, request_id: str) -> None:
        for _, slot in self._staged_for.pop(request_id, []):
            self.staging.pin(slot, unpin=True)

    # ---- lookup -----------------------------------------------------------------------------
    def lookup(self, keys: list[bytes]) -> OffloadHit:
        """The run of `keys` (the blocks after the tree's hit) held in host memory."""
        hit = OffloadHit([], [])
        for key in keys:
            slot = self.host.lookup(key)
            tier = "cpu"
            if slot is None:
                slot = self.staging.lookup(key)
                tier = self._staged_tier.get(key, "")
            if slot is None:
                break
            hit.slots.append(slot)
            hit.tiers.append(tier)
        return hit

    def must_wait(self, request_id: str, keys: list[bytes]) -> bool:
        """Whether the request waits for blocks being read from files: its read is in
        flight, or `keys` (its blocks after its host hits) start with files, whose read is
        started here once staging slots for all of them are free (the first that fit, for a
        run longer than the staging pool). Its staged blocks stay pinned for it until it
        loads them or ends."""
        staged = self._staged_for.get(request_id)
        if staged is not None:
            return any(self.staging.is_pending(k) for k, _ in staged)
        if not self.config.reads_files:
            return False
        run = []  # the keys whose files follow the host hits
        for key in keys:
            tier = self._file_tier(key)
            if tier is None:
                break
            run.append((key, tier))
        if not run:
            return False
        if len(run) > self.staging.num_available() and len(run) <= self.staging.num_slots:
            return True  # wait until its whole run fits
        staged = []
        for key, tier in run:
            slot = self.staging.allocate(key, pending=True)
            if slot is None:
                break
            self.staging.pin(slot)  # the request's own pin
            self._staged_tier[key] = tier
            self._ops.prefetch.append((key, slot))
            staged.append((key, slot))
        self._staged_for[request_id] = staged
        if len(self._staged_tier) > 2 * self.staging.num_slots:  # keep only the staged
            self._staged_tier = {k: t for k, t in self._staged_tier.items()
                                 if k in self.staging}
        return bool(staged)

    def _file_tier(self, key: bytes) -> str | None:
        if key in self._bad:
            return None
        for store in self._stores_read():
            if store.contains(key):
                return store.name
        return None

    def _stores_read(self) -> list[BlockLookup]:
        """The stores below host memory lookups search: the disk tier (while it works), then
        a consumer's transfer."""
        stores = [self.disk] if self.disk is not None and self.disk_available else []
        if self.shared is not None and self.config.transfer.consumes:
            stores.append(self.shared)
        return stores

    def load(self, request_id: str, hit: OffloadHit, block_ids: list[int]) -> None:
        """Queue the copies of a request's hit into the blocks allocated for it (its staged
        blocks are then pinned by this step's copies only)."""
        self._release_staged(request_id)
        for slot, block, tier in zip(hit.slots, block_ids, hit.tiers, strict=True):
            self._ops.load.append((slot, block))
            self.blocks_loaded[tier] += 1
            self.bytes_loaded[tier] += self.config.block_bytes
            self.hit_tokens[tier] += self.block_size

    def pin(self, slots: list[int], unpin: bool = False) -> None:
        """Keep a hit's slots from being reused until this step's copies are sent (unpin:
        the hit was not taken after all)."""
        for slot in slots:
            index = self.host if slot < self.config.host_blocks else self.staging
            index.pin(slot, unpin)
            if unpin:
                self._load_pins.remove(slot)
        if not unpin:
            self._load_pins += slots

    # ---- saving -----------------------------------------------------------------------------
    def on_evict(self, keys: list[bytes], block_ids: list[int]) -> None:
        """Full blocks leaving the prefix cache (keys parallel to block ids)."""
        for key, block in zip(keys, block_ids, strict=True):
            if self.config.host_blocks:
                if key in self.host:
                    continue
                slot = self.host.allocate(key)
                if slot is None:
                    continue
                self._ops.save_host.append((block, slot))
                self.blocks_saved["cpu"] += 1
                self.bytes_saved["cpu"] += self.config.block_bytes
            elif self.disk_available and not self.disk.contains(key):
                self._ops.save_files.append((block, key))
                self.blocks_saved["disk"] += 1

    @property
    def publishes(self) -> bool:
        """A kv_producer: its prompt blocks go to the transfer."""
        return self.config.transfer is not None and self.config.transfer.produces

    def on_prompt_computed(self, keys: list[bytes], block_ids: list[int]) -> None:
        """A producer's prompt blocks, full once this step runs: published after it."""
        for key, block in zip(keys, block_ids, strict=True):
            if not self.shared.contains(key):
                self._ops.publish.append((block, key))
                self.blocks_saved["shared"] += 1

    # ---- the step ---------------------------------------------------------------------------
    def take_ops(self) -> OffloadOps:
        ops, self._ops = self._ops, OffloadOps()
        self.pin(list(self._load_pins), unpin=True)
        return ops

    def apply(self, result: OffloadResult | None) -> None:
        """The runner's report of a step: reads confirmed or failed, bytes moved."""
        if result is None:
            return
        for key, ok in result.prefetched.items():
            if not ok:  # the requests it was read for compute it
                self._bad.add(key)
                for staged in self._staged_for.values():
                    for i, (k, slot) in enumerate(staged):
                        if k == key:
                            self.staging.pin(slot, unpin=True)
                            del staged[i]
                            break
            self.staging.confirm(key, ok)
        for tier, n in result.bytes_saved.items():
            self.bytes_saved[tier] += n
        if not result.disk_available:
            self.disk_available = False

    def clear_host(self) -> None:
        self.host.clear()
        self.staging.clear()

    def counters(self) -> tuple[tuple[str, str, int], ...]:
        """(counter, tier, total) of every counter (metrics/stats.py)."""
        named = (("blocks_stored", self.blocks_saved), ("blocks_loaded", self.blocks_loaded),
                 ("bytes_stored", self.bytes_saved), ("bytes_loaded", self.bytes_loaded),
                 ("hit_tokens", self.hit_tokens))
        return tuple((name, tier, n) for name, counts in named
                     for tier, n in sorted(counts.items()))

    def check_integrity(self) -> None:
        self.host.check_integrity()
        self.staging.check_integrity()
