"""The C++ CPU kernels (csrc/), compiled on first use with torch.utils.cpp_extension.

The build is cached by torch under ~/.cache/torch_extensions (or $TORCH_EXTENSIONS_DIR): the
first process on a machine compiles for about 30 s, later ones load the library in well under a
second. Compiled for this machine's CPU: AVX2 + FMA where available, else portable code.

`paged_attention_op()` returns the op, or None when the kernels are disabled
(TOKENMILL_CPU_KERNELS=0) or cannot be built (no compiler): callers then use the pure-PyTorch
backend, which is also the oracle the kernels are tested against.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).parent / "csrc" / "paged_attention_cpu.cpp"


def _cflags() -> list[str]:
    flags = ["-O3", "-fopenmp"]  # -fopenmp: at::parallel_for runs on torch's OpenMP pool
    if torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512"):
        # Select ATen's AVX2 Vectorized<float> (the header otherwise falls back to scalar).
        flags += ["-mavx2", "-mfma", "-DCPU_CAPABILITY=AVX2", "-DCPU_CAPABILITY_AVX2"]
    return flags


@functools.cache
def _load() -> object | None:
    if os.environ.get("TOKENMILL_CPU_KERNELS", "1") == "0":
        return None
    try:
        from torch.utils.cpp_extension import load

        return load("tokenmill_paged_attention_cpu", [str(_SOURCE)], extra_cflags=_cflags(),
                    extra_ldflags=["-fopenmp"])
    except Exception as e:  # no compiler, no headers: the torch backend still works
        logger.warning("CPU attention kernel unavailable (%s); using the PyTorch backend", e)
        return None


def paged_attention_op() -> Callable[..., torch.Tensor] | None:
    """paged_attention(q (N,Hq,D), k_cache, v_cache (nb,bs,Hkv,D), block_tables (B,max_blocks),
    seq_rows (N,), start_lens (N,), ctx_lens (N,), scale) -> [out (N,Hq,D), lse (N,Hq)]: query n
    attends cached tokens [start_lens[n], ctx_lens[n]); None if the kernel is unavailable."""
    module = _load()
    return None if module is None else module.paged_attention
