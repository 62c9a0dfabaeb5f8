"""The KV tiers' config from the engine options (EngineArgs' kv_offload group), checked
against the model and the rest of the config; and the model's KV identity, which seeds every
block key so that blocks of another model, dtype, KV format, block size or tensor split are
never found (kv_offload/block_hash.py)."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from tokenmill.attention.kv_cache import bytes_per_block
from tokenmill.config import CacheConfig, ModelConfig
from tokenmill.distributed.config import ParallelConfig
from tokenmill.kv_offload.config import KVOffloadConfig, KVTransferConfig, parse_offloading_size
from tokenmill.utils import cdiv

_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".gguf")
MIN_STAGING_BLOCKS = 16


def kv_offload_config(options: dict[str, Any], model: ModelConfig, cache: CacheConfig,
                      parallel: ParallelConfig, seed: int, has_draft: bool
                      ) -> KVOffloadConfig | None:
    """None when no tier or transfer is asked for; ValueError for what cannot run."""
    size, backend = options["kv_offloading_size"], options["kv_offloading_backend"]
    directory = options["kv_offloading_dir"]
    transfer = KVTransferConfig.parse(options["kv_transfer_config"])
    if backend is None and size is not None:
        backend = "disk" if directory is not None else "native"  # native: vLLM's default
    if directory is not None and backend != "disk":
        raise ValueError("kv_offloading_dir is the disk tier's; the native tier is CPU "
                         "memory")
    if backend is not None and size is None:
        raise ValueError(f"kv_offloading_backend {backend} needs kv_offloading_size")
    if backend == "disk" and directory is None:
        directory = default_disk_dir()
    if backend is None and transfer is None:
        return None
    _check_runs_with(model, cache, parallel, has_draft, files=backend == "disk" or
                     transfer is not None)
    block_bytes = bytes_per_block(model.num_layers, cache.block_size,
                                  model.num_kv_heads // parallel.tensor_parallel_size,
                                  model.head_dim, model.dtype, cache.kv_cache_dtype)
    nbytes = None if size is None else parse_offloading_size(size)
    host_blocks = nbytes // block_bytes if backend == "native" else 0
    if backend == "native" and host_blocks < 1:
        raise ValueError(f"kv_offloading_size {size} holds no block of {block_bytes} bytes")
    reads = backend == "disk" or (transfer is not None and transfer.consumes)
    staging = (max(MIN_STAGING_BLOCKS, cdiv(model.max_model_len, cache.block_size) + 1)
               if reads else 0)
    return KVOffloadConfig(identity=kv_identity(model, cache, parallel, seed),
                           block_bytes=block_bytes,
                           host_blocks=host_blocks,
                           disk_dir=directory if backend == "disk" else None,
                           disk_bytes=nbytes if backend == "disk" else 0,
                           transfer=transfer, staging_blocks=staging)


def default_disk_dir() -> str:
    """Where the disk tier keeps its blocks unless told: the user's cache, beside the GGUF
    conversions (blocks of different models never meet: their keys differ)."""
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(cache, "tokenmill", "kv_blocks")


def _check_runs_with(model: ModelConfig, cache: CacheConfig, parallel: ParallelConfig,
                     has_draft: bool, files: bool) -> None:
    if not cache.enable_prefix_caching:
        raise ValueError("KV offloading and transfer find blocks by their prefix: they need "
                         "enable_prefix_caching")
    if model.kv_sliding_window is not None:
        raise ValueError("KV offloading and transfer do not run with sliding-window "
                         "attention yet")
    if has_draft:
        raise ValueError("KV offloading and transfer do not run with a draft model yet (its "
                         "own KV cache would miss the blocks copied in)")
    if parallel.pipeline_parallel_size > 1:
        raise ValueError("KV offloading and transfer do not run with "
                         "pipeline_parallel_size > 1 yet")
    if files and parallel.tensor_parallel_size > 1:
        raise ValueError("the disk tier and KV transfer write one rank's blocks: they do not "
                         "run with tensor_parallel_size > 1 yet (the native tier does)")


def kv_identity(model: ModelConfig, cache: CacheConfig, parallel: ParallelConfig,
                seed: int) -> str:
    """A digest of what a block's K/V depend on besides its tokens: the weights (their files'
    names, sizes and modification times; seeded random weights by their seed), the model's
    config, dtypes, weight format, KV format, block size and tensor split."""
    parts = {
        "weights": _weight_files(model) if model.load_format != "dummy" else f"dummy:{seed}",
        "config": model.arch_config().to_dict(),
        "dtype": str(model.dtype), "weight_dtype": str(model.weight_dtype),
        "matmul_dtype": str(model.matmul_dtype), "quantization": model.quantization,
        "int8_activations": model.int8_activations,
        "kv_cache_dtype": cache.kv_cache_dtype, "block_size": cache.block_size,
        "tensor_parallel_size": parallel.tensor_parallel_size,
    }
    text = json.dumps(parts, sort_keys=True, default=str)
    return hashlib.blake2b(text.encode(), digest_size=16).hexdigest()


def _weight_files(model: ModelConfig) -> list[tuple[str, int, int]]:
    path = Path(model.gguf_file or model.path)
    files = [path] if path.is_file() else sorted(
        p for p in path.iterdir() if p.name.endswith(_WEIGHT_SUFFIXES))
    out = []
    for f in files:
        st = os.stat(f)
        out.append((f.name, st.st_size, st.st_mtime_ns))
    return out
