"""The KV cache's size when the user sets none (`kv_cache_memory=None`), as vLLM sizes its CPU
KV space: what is free after the weights are loaded, not a fixed figure.

On CPU: half the memory the kernel reports available (MemAvailable) once the weights are in,
less the weights used in place from a file's map (page cache, which MemAvailable counts as
available: utils/file_maps.py), split over the ranks of this engine, and never more than its
longest possible batch needs (max_num_seqs sequences of max_model_len tokens). The CPU cache
is fresh anonymous memory (attention/kv_cache.py), so blocks never used cost no resident
memory. On CUDA the budget is a profiled step's (worker/memory_profile.py,
gpu_memory_utilization); DEFAULT_KV_BYTES where neither applies. The choice is logged.
"""

from __future__ import annotations

import logging

import torch

from tokenmill.config import EngineConfig
from tokenmill.utils import cdiv

logger = logging.getLogger(__name__)

DEFAULT_KV_BYTES = 2 << 30
FREE_FRACTION = 0.5


def available_memory() -> int | None:
    """MemAvailable of /proc/meminfo in bytes (None where there is none: not Linux)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def longest_batch_bytes(config: EngineConfig, block_bytes: int) -> int:
    """What the longest possible batch needs: max_num_seqs sequences of max_model_len tokens
    in whole blocks, and the null block."""
    blocks_per_seq = cdiv(config.model.max_model_len, config.cache.block_size)
    return (config.scheduler.max_num_seqs * blocks_per_seq + 1) * block_bytes


def auto_kv_budget(config: EngineConfig, block_bytes: int, device: torch.device,
                   mapped_weights: int = 0) -> int:
    """Bytes for this rank's KV cache (module doc); mapped_weights: the bytes of this rank's
    weights that are a file's pages."""
    free = available_memory() if device.type == "cpu" else None
    if free is None:
        return DEFAULT_KV_BYTES
    free = max(0, free - mapped_weights)
    ranks = config.parallel.world_size
    needed = longest_batch_bytes(config, block_bytes)
    share = int(free * FREE_FRACTION) // ranks
    budget = min(needed, share)
    logger.info("KV cache budget %.2f GiB: %.0f%% of the %.2f GiB available after the "
                "weights%s, at most what %d sequences of %d tokens need (%.2f GiB); set "
                "kv_cache_memory to choose", budget / 2**30, FREE_FRACTION * 100, free / 2**30,
                f", over {ranks} ranks" if ranks > 1 else "", config.scheduler.max_num_seqs,
                config.model.max_model_len, needed / 2**30)
    return budget


def num_kv_blocks(config: EngineConfig, block_bytes: int, device: torch.device,
                  profiled: int | None = None, mapped_weights: int = 0) -> int:
    """Blocks of the KV cache: the configured count, else the budget (kv_cache_memory, a
    profiled step's (CUDA: worker/memory_profile.py), or the automatic one, which leaves
    `mapped_weights` bytes of file-backed weights their memory) over a block's bytes
    (ValueError below 2)."""
    cache = config.cache
    if cache.num_kv_blocks is not None:
        return cache.num_kv_blocks
    budget = cache.kv_cache_memory if cache.kv_cache_memory is not None else profiled
    if budget is None:
        budget = auto_kv_budget(config, block_bytes, device, mapped_weights)
    n = budget // block_bytes
    if n < 2:
        what = ("kv_cache_memory" if cache.kv_cache_memory is not None else
                "the KV budget" if profiled is None else "gpu_memory_utilization's KV budget")
        raise ValueError(f"{what}={budget} bytes holds {n} blocks; one block of "
                         f"{cache.block_size} tokens needs {block_bytes} bytes and at least "
                         "2 are required")
    return n


def allocate_swap(config: EngineConfig, kv_cache: torch.Tensor, block_bytes: int
                  ) -> tuple[int, torch.Tensor | None]:
    """CPU memory for swapped-out KV, laid out as the cache's blocks (pinned on CUDA for fast
    copies): (blocks, tensor), or (0, None) outside swap mode."""
    if config.scheduler.preemption_mode != "swap":
        return 0, None
    n = config.cache.swap_space // block_bytes
    shape = kv_cache.shape
    swap = torch.zeros(shape[0], 2, n, *shape[3:], dtype=kv_cache.dtype,
                       pin_memory=kv_cache.device.type == "cuda")
    return n, swap
