"""Where a block's file lives: `DIR/<key[:2]>/<key>.kv` (hex key; 256 fan-out directories).
Pure Python: the scheduler's side asks whether a file is there without importing torch."""

from __future__ import annotations

from pathlib import Path


def block_path(directory: str | Path, key: bytes) -> Path:
    hexkey = key.hex()
    return Path(directory) / hexkey[:2] / f"{hexkey}.kv"


def block_exists(directory: str | Path, key: bytes) -> bool:
    return block_path(directory, key).is_file()
