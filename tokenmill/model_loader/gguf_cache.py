"""A converted copy of each GGUF model, so that only the first start pays for the conversion.

Reading a GGUF file costs seconds that have nothing to do with serving: the gguf package parses
every metadata array in Python (the 49k-token vocabulary and merges, twice: once for the config,
once inside transformers for the tokenizer), transformers converts that vocabulary into a fast
tokenizer, and every tensor is dequantized in numpy. The first load therefore writes what it
built into a folder that reads like a Hugging Face model: config.json, the tokenizer files
(with the chat template) and where each tensor lies (gguf_index.py) at once, float32 weights
in model.safetensors the first time a start
needs them (gguf_convert.py `converted_weights`: the file served dequantized, int4's
calibration); a file served in its own blocks (quantization="gguf") never writes them. Later
loads read that. This module names the folders; gguf_convert.py writes them.

Layout: $TOKENMILL_CACHE_DIR (default ~/.cache/tokenmill)/gguf/<key>/ where the key hashes the
file's absolute path, size and modification time and the format version, so an edited or
replaced file is converted again. The folder is written under a temporary name and renamed
when complete: a crashed or concurrent first start never leaves a half folder in use.
TOKENMILL_GGUF_CACHE=0 turns the cache off; the weights of models whose float32 weights would
exceed MAX_CACHED_BYTES are never cached (the copy would cost more disk than it saves time).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

_FORMAT_VERSION = 3  # 2: weights written on demand; 3: the tensor index (gguf_index.py)
FULL_CONFIG = "tokenmill_full_config.json"
MAX_CACHED_BYTES = 4 << 30


def cache_root() -> Path:
    return Path(os.environ.get("TOKENMILL_CACHE_DIR",
                               os.path.join(os.path.expanduser("~"), ".cache", "tokenmill")))


def keyed_name(gguf_path: str, *extra: object) -> str:
    """`<stem>-<hash>`: a cache name that changes when the file (path, size, mtime) or any of
    `extra` (a format version) changes."""
    st = os.stat(gguf_path)
    key = "|".join(map(str, (os.path.abspath(gguf_path), st.st_size, st.st_mtime_ns, *extra)))
    return Path(gguf_path).stem + "-" + hashlib.sha256(key.encode()).hexdigest()[:16]


def folder_for(gguf_path: str) -> Path:
    return cache_root() / "gguf" / keyed_name(gguf_path, _FORMAT_VERSION)


def cached_folder(gguf_path: str) -> str | None:
    """The converted folder of `gguf_path` if an earlier start completed it (never creates)."""
    if os.environ.get("TOKENMILL_GGUF_CACHE", "1") == "0":
        return None
    folder = folder_for(gguf_path)
    return str(folder) if (folder / FULL_CONFIG).is_file() else None


def load_full_config(folder: str) -> Any:
    """The converted model's transformers config, without importing its architecture class."""
    from transformers.configuration_utils import PretrainedConfig

    with open(os.path.join(folder, FULL_CONFIG)) as f:
        return PretrainedConfig(**json.load(f))
