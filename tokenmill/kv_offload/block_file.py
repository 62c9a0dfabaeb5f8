"""One KV block on disk: a self-checking file named by its key.

    DIR/<key[:2]>/<key>.kv (block_paths.py) =
        b"TMKV1\\n" | u32 header length | header JSON | payload

The header holds the model's KV identity, the key, the payload's dtype, shape, byte length
and CRC-32. `read_block` returns None for anything that is not exactly the block asked for: a
missing, truncated or corrupt file (length or checksum), another model's or format's file
(identity, dtype or shape), a file renamed to another key. Writes go to a temporary name in
the same directory and are renamed into place, so a writer killed mid-file leaves nothing a
reader would take for a block.
"""

from __future__ import annotations

import contextlib
import json
import os
import struct
import tempfile
import zlib
from pathlib import Path

import torch

from tokenmill.kv_offload.block_paths import block_path

MAGIC = b"TMKV1\n"
_LEN = struct.Struct("<I")


def write_block(directory: str | Path, key: bytes, identity: str, block: torch.Tensor) -> int:
    """Write a block (a CPU tensor) atomically; returns the file's size in bytes. OSError
    (a full disk, a read-only directory) propagates: the caller decides what it means."""
    payload = block.contiguous().view(torch.uint8).numpy().tobytes()
    header = json.dumps({"identity": identity, "key": key.hex(),
                         "dtype": str(block.dtype).removeprefix("torch."),
                         "shape": list(block.shape), "nbytes": len(payload),
                         "crc32": zlib.crc32(payload)}).encode()
    path = block_path(directory, key)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=".kv")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(MAGIC + _LEN.pack(len(header)) + header)
            f.write(payload)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return len(MAGIC) + _LEN.size + len(header) + len(payload)


def read_block(directory: str | Path, key: bytes, identity: str, dtype: torch.dtype,
               shape: tuple[int, ...]) -> torch.Tensor | None:
    """The block stored under `key`, checked; None if it is absent or not exactly it."""
    try:
        data = block_path(directory, key).read_bytes()
    except OSError:
        return None
    return decode_block(data, key, identity, dtype, shape)


def decode_block(data: bytes, key: bytes, identity: str, dtype: torch.dtype,
                 shape: tuple[int, ...]) -> torch.Tensor | None:
    head = len(MAGIC) + _LEN.size
    if len(data) < head or not data.startswith(MAGIC):
        return None
    (n,) = _LEN.unpack_from(data, len(MAGIC))
    try:
        header = json.loads(data[head:head + n])
    except ValueError:
        return None
    payload = memoryview(data)[head + n:]
    expected = {"identity": identity, "key": key.hex(),
                "dtype": str(dtype).removeprefix("torch."), "shape": list(shape),
                "nbytes": len(payload)}
    if not isinstance(header, dict) or any(header.get(k) != v for k, v in expected.items()):
        return None
    if header.get("crc32") != zlib.crc32(payload):
        return None
    return torch.frombuffer(bytearray(payload), dtype=torch.uint8).view(dtype).view(shape)

