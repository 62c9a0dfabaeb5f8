"""OffloadWorker: the runner's side of the KV tiers. It owns the host tensor (the host tier's
slots, then the staging slots of blocks read from files, laid out as the KV cache's blocks) and
the block directories, and does a step's OffloadOps (kv_offload/ops.py) in their order.

Host copies move whole blocks across all layers: `host[:, :, slots] = kv_cache[:, :, blocks]`
(pinned memory on CUDA). A block read from a file is checked (block_file.py) before it enters a
staging slot; one that fails is reported, never copied. What a step did is reported with the
next output the runner returns (`take_result`), so a step that fails after its block
operations loses no report.
"""

from __future__ import annotations

import torch

from tokenmill.kv_offload.config import KVOffloadConfig
from tokenmill.kv_offload.file_store import FileStore, connector_store
from tokenmill.kv_offload.ops import OffloadOps, OffloadResult


class OffloadWorker:
    def __init__(self, config: KVOffloadConfig, kv_cache: torch.Tensor) -> None:
        self.config = config
        num_slots = config.host_blocks + config.staging_blocks
        layers, two, _, *block = kv_cache.shape  # (L, 2, num_blocks, bs, Hkv, R)
        self.block_shape = (layers, two, *block)
        self.host = torch.empty(layers, two, num_slots, *block, dtype=kv_cache.dtype,
                                pin_memory=kv_cache.device.type == "cuda")
        self.disk = (None if config.disk_dir is None else
                     FileStore("disk", config.disk_dir, config.disk_bytes, config.identity,
                               kv_cache.dtype, self.block_shape))
        transfer = config.transfer
        self.shared = (None if transfer is None else
                       connector_store(transfer, config.identity, kv_cache.dtype,
                                       self.block_shape))
        self._result = OffloadResult()

    def save(self, ops: OffloadOps, kv_cache: torch.Tensor) -> None:
        """Blocks evicted this step, copied out before anything overwrites them."""
        if ops.save_host:
            blocks, slots = zip(*ops.save_host, strict=True)
            self.host[:, :, list(slots)] = kv_cache[:, :, list(blocks)].to("cpu")
        for block, key in ops.save_files:
            if self.disk is not None:  # a private copy: the block is reused this step
                self.disk.write_async(key, kv_cache[:, :, block].to("cpu", copy=True))

    def load(self, ops: OffloadOps, kv_cache: torch.Tensor) -> None:
        """Files read into staging slots (checked), then host slots into this step's hits."""
        for key, slot in ops.prefetch:
            block = self._read(key)
            if block is not None:
                self.host[:, :, slot] = block
            self._result.prefetched[key] = block is not None
        if ops.load:
            slots, blocks = zip(*ops.load, strict=True)
            kv_cache[:, :, list(blocks)] = self.host[:, :, list(slots)].to(kv_cache.device)

    def _read(self, key: bytes) -> torch.Tensor | None:
        for store in (self.disk, self.shared):
            block = None if store is None else store.read(key)
            if block is not None:
                return block
        return None

    def publish(self, ops: OffloadOps, kv_cache: torch.Tensor) -> None:
        """A producer's prompt blocks computed this step, written before the step returns."""
        if self.shared is None:
            return
        for block, key in ops.publish:
            self.shared.write(key, kv_cache[:, :, block].to("cpu"))

    def take_result(self) -> OffloadResult | None:
        """What the steps since the last call did (None: nothing)."""
        result, self._result = self._result, OffloadResult()
        for store in (self.disk, self.shared):
            if store is not None and (n := store.take_bytes_written()):
                result.bytes_saved[store.name] = n
        result.disk_available = self.disk is None or self.disk.available
        if not (result.prefetched or result.bytes_saved or not result.disk_available):
            return None
        return result

    def close(self) -> None:
        for store in (self.disk, self.shared):
            if store is not None:
                store.close()
