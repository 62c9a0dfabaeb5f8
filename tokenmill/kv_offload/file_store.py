"""FileStore: a directory of block files (block_file.py), the BlockStore of the disk tier (bounded
in bytes, least recently used out) and of the shared storage connector (unbounded). The
runner's side: it writes, reads and deletes; the scheduler only asks whether a file exists
(connector.py's DirectoryLookup).

At start-up the directory is created if needed and must be writable (else a ValueError names
it); the files already there (an earlier process's) are taken in, oldest modification first.
The disk tier's writes run on one background thread, off the step's critical path (a block
waiting to be written is served from memory); a producer's are done before its step returns.
A failed write (a full disk) turns the store off with a warning: nothing more is written, and
for the disk tier the scheduler stops looking (`available`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
import threading
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from tokenmill.kv_offload.block_file import read_block, write_block
from tokenmill.kv_offload.block_paths import block_path
from tokenmill.kv_offload.block_store import BlockStore
from tokenmill.kv_offload.config import KVTransferConfig

logger = logging.getLogger(__name__)


def check_writable(directory: str) -> None:
    """ValueError unless `directory` exists (or can be made) and takes files."""
    try:
        Path(directory).mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(dir=directory, prefix=".probe-")
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise ValueError(f"KV block directory {directory!r} is not writable: {e}") from e


class FileStore(BlockStore):
    def __init__(self, name: str, directory: str, max_bytes: int | None, identity: str,
                 dtype: torch.dtype, shape: tuple[int, ...]) -> None:
        check_writable(directory)
        self.name = name
        self.dtype, self.shape = dtype, shape  # a block's, as the cache holds it
        self.directory = directory
        self.max_bytes = max_bytes  # None: unbounded (a shared transfer directory)
        self.identity = identity
        self.available = True
        self._lock = threading.Lock()
        self._files: OrderedDict[str, int] = OrderedDict()  # path → bytes, oldest first
        self._bytes = 0
        self._pending: dict[bytes, torch.Tensor] = {}  # key → block being written
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="kv-disk")
        self.bytes_written = 0  # since the last take_bytes_written
        if max_bytes is not None:
            self._scan()

    def _scan(self) -> None:
        found = []
        for path in Path(self.directory).glob("*/*.kv"):
            try:
                st = path.stat()
            except OSError:
                continue
            found.append((st.st_mtime_ns, str(path), st.st_size))
        for _, path, size in sorted(found):
            self._files[path] = size
            self._bytes += size
        self._shrink()

    def read(self, key: bytes) -> torch.Tensor | None:
        with self._lock:
            block = self._pending.get(key)  # being written this very moment
        if block is None:
            block = read_block(self.directory, key, self.identity, self.dtype, self.shape)
        if block is not None:
            self.touch(key)
        return block

    def write_async(self, key: bytes, block: torch.Tensor) -> None:
        """Write a block (a private CPU copy) on the writer thread."""
        if not self.available:
            return
        with self._lock:
            self._pending[key] = block
        self._writer.submit(self._write, key, block)

    def write(self, key: bytes, block: torch.Tensor) -> bool:
        """Write now (a producer's blocks, before its step returns); False if it failed."""
        return self.available and self._write(key, block)

    def _write(self, key: bytes, block: torch.Tensor) -> bool:
        try:
            size = write_block(self.directory, key, self.identity, block)
        except OSError as e:
            if self.available:
                logger.warning("KV blocks can no longer be written to %s (%s): the %s store "
                               "is off", self.directory, e, self.name)
            self.available = False
            return False
        finally:
            with self._lock:
                self._pending.pop(key, None)
        with self._lock:
            path = str(block_path(self.directory, key))
            self._bytes += size - self._files.pop(path, 0)
            self._files[path] = size
            self.bytes_written += size
            self._shrink()
        return True

    def touch(self, key: bytes) -> None:
        """A block was read: it is the most recently used."""
        path = str(block_path(self.directory, key))
        with self._lock:
            if path in self._files:
                self._files.move_to_end(path)
        with contextlib.suppress(OSError):
            os.utime(path)  # so that a restart keeps the order

    def _shrink(self) -> None:
        """Delete the oldest files beyond the budget (the lock held)."""
        while self.max_bytes is not None and self._bytes > self.max_bytes and self._files:
            path, size = self._files.popitem(last=False)
            self._bytes -= size
            with contextlib.suppress(OSError):
                os.unlink(path)

    def take_bytes_written(self) -> int:
        """Bytes written since the last call."""
        with self._lock:
            n, self.bytes_written = self.bytes_written, 0
        return n

    @property
    def num_bytes(self) -> int:
        return self._bytes

    def flush(self) -> None:
        """Wait for the writes queued so far."""
        self._writer.submit(lambda: None).result()

    def close(self) -> None:
        self._writer.shutdown(wait=True)


def connector_store(transfer: KVTransferConfig, identity: str, dtype: torch.dtype,
                    shape: tuple[int, ...]) -> BlockStore:
    """The runner's half of a `--kv-transfer-config` connector (connector.py has the
    scheduler's)."""
    if transfer.kv_connector == "SharedStorageConnector":
        # vLLM's connector does not bound its directory either
        return FileStore("shared", transfer.shared_storage_path, None, identity, dtype, shape)
    raise ValueError(f"unknown kv_connector {transfer.kv_connector!r}")
