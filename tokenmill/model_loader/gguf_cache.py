"""A converted copy of each GGUF model, so that only the first start pays for the conversion.

Reading a GGUF file costs seconds that have nothing to do with serving: the gguf package parses
every metadata array in Python (the 49k-token vocabulary and merges, twice: once for the config,
once inside transformers for the tokenizer), transformers converts that vocabulary into a fast
tokenizer, and every tensor is dequantized in numpy. The first load therefore writes what it
built into a folder that reads like a Hugging Face model: config.json, the tokenizer files
(with the chat template) and where each tensor lies (gguf_index.py) at once, float32 weights
in model.safetensors the first time a start
needs them (`converted_weights`: the file served dequantized, int4's calibration); a file
served in its own blocks (quantization="gguf") never writes them. Later loads read that.

Layout: $TOKENMILL_CACHE_DIR (default ~/.cache/tokenmill)/gguf/<key>/ where the key hashes the
file's absolute path, size and modification time and the format version, so an edited or
replaced file is converted again. The folder is written under a temporary name and renamed
when complete: a crashed or concurrent first start never leaves a half folder in use.
TOKENMILL_GGUF_CACHE=0 turns the cache off; the weights of models whose float32 weights would
exceed _MAX_CACHED_BYTES are never cached (the copy would cost more disk than it saves time).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

_FORMAT_VERSION = 3  # 2: weights written on demand; 3: the tensor index (gguf_index.py)
_FULL_CONFIG = "tokenmill_full_config.json"
_MAX_CACHED_BYTES = 4 << 30


def cache_root() -> Path:
    return Path(os.environ.get("TOKENMILL_CACHE_DIR",
                               os.path.join(os.path.expanduser("~"), ".cache", "tokenmill")))


def keyed_name(gguf_path: str, *extra: object) -> str:
    """`<stem>-<hash>`: a cache name that changes when the file (path, size, mtime) or any of
    `extra` (a format version) changes."""
    st = os.stat(gguf_path)
    key = "|".join(map(str, (os.path.abspath(gguf_path), st.st_size, st.st_mtime_ns, *extra)))
    return Path(gguf_path).stem + "-" + hashlib.sha256(key.encode()).hexdigest()[:16]


def _folder_for(gguf_path: str) -> Path:
    return cache_root() / "gguf" / keyed_name(gguf_path, _FORMAT_VERSION)


def converted_folder(gguf_path: str) -> str | None:
    """The converted folder of `gguf_path`, creating it on first use; None if disabled or the
    conversion could not be written (the caller then reads the GGUF file directly)."""
    if os.environ.get("TOKENMILL_GGUF_CACHE", "1") == "0":
        return None
    folder = _folder_for(gguf_path)
    if (folder / _FULL_CONFIG).is_file():
        return str(folder)
    try:
        return _convert(gguf_path, folder)
    except OSError as e:  # read-only or full disk: serving still works from the GGUF file
        logger.warning("cannot cache the converted GGUF model in %s (%s)", folder, e)
        return None


def cached_folder(gguf_path: str) -> str | None:
    """The converted folder of `gguf_path` if an earlier start completed it (never creates)."""
    if os.environ.get("TOKENMILL_GGUF_CACHE", "1") == "0":
        return None
    folder = _folder_for(gguf_path)
    return str(folder) if (folder / _FULL_CONFIG).is_file() else None


def load_full_config(folder: str) -> Any:
    """The converted model's transformers config, without importing its architecture class."""
    from transformers.configuration_utils import PretrainedConfig

    with open(os.path.join(folder, _FULL_CONFIG)) as f:
        return PretrainedConfig(**json.load(f))


def converted_weights(folder: str, gguf_path: str) -> str | None:
    """`folder` once it holds the float32 weights of `gguf_path` (written now if missing);
    None where they are not cached (too large, or the disk refuses): read the GGUF file."""
    from safetensors.torch import save_file
    from tqdm import tqdm

    from tokenmill.model_loader.gguf_loader import gguf_num_elements, gguf_num_tensors, iterate_gguf

    target = Path(folder) / "model.safetensors"
    if target.is_file():
        return folder
    if 4 * gguf_num_elements(gguf_path) > _MAX_CACHED_BYTES:  # float32 once converted
        return None
    t0 = time.perf_counter()
    tensors = tqdm(iterate_gguf(gguf_path, load_full_config(folder)),
                   total=gguf_num_tensors(gguf_path), desc="converting GGUF", unit="tensor")
    fd, tmp = tempfile.mkstemp(prefix="model.safetensors.tmp-", dir=folder)
    os.close(fd)
    try:
        save_file({n: t.contiguous() for n, t in tensors}, tmp, metadata={"source": gguf_path})
        os.replace(tmp, target)  # whole or absent: a concurrent start writes its own tmp
    except OSError as e:
        logger.warning("cannot cache the float32 weights in %s (%s)", folder, e)
        return None
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    logger.info("GGUF weights converted to float32 in %.1f s", time.perf_counter() - t0)
    return folder


def _convert(gguf_path: str, folder: Path) -> str | None:
    from tokenmill.engine.tokenizer import gguf_tokenizer
    from tokenmill.model_loader.gguf_index import build_index, write_index
    from tokenmill.model_loader.gguf_loader import _reader, gguf_hf_config

    hf_config = gguf_hf_config(gguf_path)
    logger.info("first start with %s: converting it once into %s (later starts skip this)",
                gguf_path, folder)
    t0 = time.perf_counter()
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=folder.name + ".tmp-", dir=folder.parent))
    try:
        hf_config.save_pretrained(tmp)  # config.json for other tools; tokenmill reads the
        # full dump below (every attribute, defaults included) as a plain PretrainedConfig,
        # which skips importing the architecture's config class (about 1.4 s of imports).
        gguf_tokenizer(gguf_path, hf_config.model_type).save_pretrained(tmp)
        write_index(build_index(_reader(gguf_path)), str(tmp))  # later starts skip the reader
        with open(tmp / _FULL_CONFIG, "w") as f:  # written last: it marks the folder complete
            json.dump(hf_config.to_dict(), f, indent=1)
        try:
            os.replace(tmp, folder)
        except OSError:  # another process finished first: use its copy
            if not (folder / _FULL_CONFIG).is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    logger.info("GGUF converted in %.1f s", time.perf_counter() - t0)
    return str(folder)
