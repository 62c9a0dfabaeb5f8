"""Writing the converted copy of a GGUF model (gguf_cache.py names the folder): its config,
tokenizer and tensor index on the first start, its float32 weights the first time a start needs
them. Each is written under a temporary name and renamed when complete.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path

from safetensors.torch import save_file
from tqdm import tqdm

from tokenmill.engine.tokenizer import gguf_tokenizer
from tokenmill.model_loader.gguf_cache import (
    FULL_CONFIG,
    MAX_CACHED_BYTES,
    folder_for,
    load_full_config,
)
from tokenmill.model_loader.gguf_index import build_index, write_index
from tokenmill.model_loader.gguf_loader import (
    gguf_hf_config,
    gguf_num_elements,
    gguf_num_tensors,
    gguf_reader,
    iterate_gguf,
)

logger = logging.getLogger(__name__)


def converted_folder(gguf_path: str) -> str | None:
    """The converted folder of `gguf_path`, creating it on first use; None if disabled or the
    conversion could not be written (the caller then reads the GGUF file directly)."""
    if os.environ.get("TOKENMILL_GGUF_CACHE", "1") == "0":
        return None
    folder = folder_for(gguf_path)
    if (folder / FULL_CONFIG).is_file():
        return str(folder)
    try:
        return _convert(gguf_path, folder)
    except OSError as e:  # read-only or full disk: serving still works from the GGUF file
        logger.warning("cannot cache the converted GGUF model in %s (%s)", folder, e)
        return None


def converted_weights(folder: str, gguf_path: str) -> str | None:
    """`folder` once it holds the float32 weights of `gguf_path` (written now if missing);
    None where they are not cached (too large, or the disk refuses): read the GGUF file."""
    target = Path(folder) / "model.safetensors"
    if target.is_file():
        return folder
    if 4 * gguf_num_elements(gguf_path) > MAX_CACHED_BYTES:  # float32 once converted
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
        write_index(build_index(gguf_reader(gguf_path)), str(tmp))  # later starts skip the reader
        with open(tmp / FULL_CONFIG, "w") as f:  # written last: it marks the folder complete
            json.dump(hf_config.to_dict(), f, indent=1)
        try:
            os.replace(tmp, folder)
        except OSError:  # another process finished first: use its copy
            if not (folder / FULL_CONFIG).is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    logger.info("GGUF converted in %.1f s", time.perf_counter() - t0)
    return str(folder)
