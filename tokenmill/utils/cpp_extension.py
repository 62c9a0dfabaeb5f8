"""Builds and loads the C++ CPU kernels in tokenmill/csrc/ with torch.utils.cpp_extension.

Each extension is compiled on first use and cached by torch under ~/.cache/torch_extensions
(or $TORCH_EXTENSIONS_DIR): the first process on a machine compiles for about 30 s, later ones
load the library in well under a second. Compiled for this machine's CPU: AVX2 + FMA where
available, else portable code.

`load_cpu_extension(name)` returns the module, or None when the kernels are disabled
(TOKENMILL_CPU_KERNELS=0) or cannot be built (no compiler): every caller then keeps a
pure-PyTorch path, which is also the oracle the kernels are tested against.

`prebuild_cpu_extensions()` starts every kernel's build (or cached load) at once on background
threads, so a first start compiles them side by side while the model loads instead of one
after another at first use; each build is logged with its duration.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

CSRC = Path(__file__).resolve().parent.parent / "csrc"
EXTENSIONS = ("cpu_ops", "paged_attention_cpu", "decode_layers_cpu")
_lock = threading.Lock()
_name_locks: dict[str, threading.Lock] = {}
_modules: dict[str, object | None] = {}


def cflags() -> list[str]:
    """Compiler flags for the CPU kernels on this machine."""
    flags = ["-O3", "-fopenmp"]  # -fopenmp: at::parallel_for runs on torch's OpenMP pool
    if torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512"):
        # Select ATen's AVX2 Vectorized<float> (the header otherwise falls back to scalar).
        flags += ["-mavx2", "-mfma", "-DCPU_CAPABILITY=AVX2", "-DCPU_CAPABILITY_AVX2"]
    return flags


def kernels_enabled() -> bool:
    return os.environ.get("TOKENMILL_CPU_KERNELS", "1") != "0"


def load_cpu_extension(name: str) -> object | None:
    """csrc/<name>.cpp built as the module tokenmill_<name>; None if disabled or unbuildable."""
    if not kernels_enabled():
        return None
    with _lock:
        name_lock = _name_locks.setdefault(name, threading.Lock())
    with name_lock:  # one build per name, however many threads ask at once
        if name not in _modules:
            _modules[name] = _build(name)
        return _modules[name]


def _build(name: str) -> object | None:
    try:
        from torch.utils.cpp_extension import load

        t0 = time.perf_counter()
        module = load(f"tokenmill_{name}", [str(CSRC / f"{name}.cpp")], extra_cflags=cflags(),
                      extra_include_paths=[str(CSRC)], extra_ldflags=["-fopenmp"])
        logger.info("C++ kernels %s ready in %.1f s (%s)", name, time.perf_counter() - t0,
                    torch.backends.cpu.get_cpu_capability())
        return module
    except Exception as e:  # no compiler, no headers: the PyTorch paths still work
        logger.warning("C++ kernels %s unavailable (%s); using PyTorch ops", name, e)
        return None


def prebuild_cpu_extensions() -> list[threading.Thread]:
    """Build or load every CPU kernel now, side by side on daemon threads (see module doc)."""
    if not kernels_enabled():
        return []
    threads = [threading.Thread(target=load_cpu_extension, args=(n,), daemon=True,
                                name=f"build-{n}") for n in EXTENSIONS]
    for t in threads:
        t.start()
    return threads
