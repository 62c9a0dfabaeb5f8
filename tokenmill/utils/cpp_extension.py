"""Builds and loads the C++ CPU kernels in tokenmill/csrc/ with torch.utils.cpp_extension.

Each kernel exists in three builds, chosen at run time by this CPU's flags (never the build
machine's): "avx512" (AVX-512 F/BW/VL/DQ + VNNI, ATen's 16-lane Vectorized), "avx2" (AVX2 + FMA
+ F16C, 8 lanes) and "generic" (portable code). `pip install` compiles the builds the installing
CPU can run, or all three with TOKENMILL_KERNEL_ISAS=all (setup.py imports this file for the
flags and the choice), into tokenmill/_C/ as `<name>_<isa>`; when this CPU's build is missing
or does not load (no compiler at install time, another torch, an environment moved to another
CPU), the kernel is compiled on first use instead and cached by torch under
~/.cache/torch_extensions (or $TORCH_EXTENSIONS_DIR), about 25 s a kernel.

`load_cpu_extension(name)` returns the module, or None when the kernels are disabled
(TOKENMILL_CPU_KERNELS=0) or cannot be built (no compiler): every caller then keeps a
pure-PyTorch path, which is also the oracle the kernels are tested against.

`prebuild_cpu_extensions()` starts every kernel's build (or cached load) at once on background
threads, so a first start compiles them side by side while the model loads instead of one
after another at first use; each build is logged with its duration.
"""

from __future__ import annotations

import importlib
import logging
import os
import threading
import time
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

CSRC = Path(__file__).resolve().parent.parent / "csrc"
# The torch version the install-time builds were compiled against (written by setup.py).
BUILD_INFO = str(Path(__file__).resolve().parent.parent / "_C" / "torch_version.txt")
# Slowest to compile first: setup.py builds them in this order, one per core.
EXTENSIONS = ("decode_layers_cpu", "cpu_ops", "paged_attention_cpu")
_lock = threading.Lock()
_name_locks: dict[str, threading.Lock] = {}
_modules: dict[str, object | None] = {}


ISAS = ("avx512", "avx2", "generic")
# Which builds `pip install` compiles: "native" (the default) those this CPU can run, as
# llama.cpp's GGML_NATIVE builds for its build machine (on an AVX2-only CPU the AVX-512 build
# could never load); "all" every
# build, for a wheel or a virtual environment that moves between CPUs.
INSTALL_ISAS_ENV = "TOKENMILL_KERNEL_ISAS"


def cpuinfo_field(name: str) -> str | None:
    """The first CPU's `name` line of /proc/cpuinfo ("flags", "model name"), or None."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == name:
                    return value.strip()
    except OSError:
        pass
    return None


def cpu_flags() -> set[str]:
    """The CPU's feature flags as Linux reports them (empty where /proc/cpuinfo is absent)."""
    return set((cpuinfo_field("flags") or "").split())


def runtime_isa() -> str:
    """The build this CPU runs, from its flags at run time: "avx512" where torch finds AVX-512
    F/BW/VL/DQ and the CPU also has AVX-512 VNNI (the int8 dot products), else "avx2"
    where torch finds AVX2 or AVX-512, else "generic"."""
    capability = torch.backends.cpu.get_cpu_capability()
    if capability == "AVX512" and "avx512_vnni" in cpu_flags():
        return "avx512"
    return "avx2" if capability in ("AVX2", "AVX512") else "generic"


def has_bf16_instructions() -> bool:
    """Whether the kernels multiply bfloat16 with AVX512-BF16's instructions here (the
    "avx512" build runs and the CPU reports avx512_bf16; csrc/linear_bf16.h checks the same at
    run time), rather than their emulation."""
    return runtime_isa() == "avx512" and "avx512_bf16" in cpu_flags()


def has_amx_bf16() -> bool:
    """Whether bfloat16 products would take AMX tiles here (csrc/linear_bf16_amx.h): the
    instructions' build runs, the CPU reports amx_tile and amx_bf16, and TOKENMILL_AMX is not
    0. The kernel also needs Linux's grant of the tile state, which it asks for itself."""
    flags = cpu_flags()
    return (has_bf16_instructions() and "amx_tile" in flags and "amx_bf16" in flags
            and os.environ.get("TOKENMILL_AMX", "1") != "0")


def runnable_isas() -> list[str]:
    """The builds this CPU can execute, fastest first (an AVX-512 CPU runs all three)."""
    return list(ISAS[ISAS.index(runtime_isa()):])


def install_isas() -> list[str]:
    """The builds `pip install` compiles (INSTALL_ISAS_ENV: "native" or "all")."""
    choice = os.environ.get(INSTALL_ISAS_ENV, "native")
    if choice not in ("native", "all"):
        raise ValueError(f"{INSTALL_ISAS_ENV} must be 'native' or 'all', got {choice!r}")
    return list(ISAS) if choice == "all" else runnable_isas()


def cflags(isa: str | None = None) -> list[str]:
    """Compiler flags of the `isa` build (default: the one this machine runs)."""
    # -fopenmp: at::parallel_for runs on torch's OpenMP pool. -g0: setuptools passes Python's
    # CFLAGS, which carry -g; debug info made each install-time build ~1.5x slower to compile
    # (decode_layers_cpu's portable build: 170 s against 110 on Zen 3).
    flags = ["-O3", "-g0", "-fopenmp"]
    isa = isa or runtime_isa()
    if isa in ("avx2", "avx512"):  # F16C: the float16 scales of quantized weights
        flags += ["-mavx2", "-mfma", "-mf16c"]
    # Select ATen's Vectorized<float> of that width (the header otherwise falls back to scalar).
    if isa == "avx2":
        flags += ["-DCPU_CAPABILITY=AVX2", "-DCPU_CAPABILITY_AVX2"]
    elif isa == "avx512":
        flags += ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512vnni",
                  "-DCPU_CAPABILITY=AVX512", "-DCPU_CAPABILITY_AVX512"]
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


def _installed_build(name: str, isa: str) -> object:
    """The install-time build; ImportError when missing or compiled against another torch
    (C++ extensions have no stable ABI across torch versions)."""
    try:
        with open(BUILD_INFO) as f:
            built_with = f.read().strip()
    except OSError:
        raise ImportError("no kernels were compiled at install time") from None
    if built_with != torch.__version__:
        raise ImportError(f"compiled against torch {built_with}, running {torch.__version__}")
    return importlib.import_module(f"tokenmill._C.{name}_{isa}")


def _build(name: str) -> object | None:
    isa = runtime_isa()
    try:
        t0 = time.perf_counter()
        module = _installed_build(name, isa)
        logger.info("C++ kernels %s: the %s build (compiled at install time) loaded in %.2f s",
                    name, isa, time.perf_counter() - t0)
        return module
    except ImportError as e:  # not built at install time, or for another torch
        logger.info("C++ kernels %s (%s) were not built at install time (%s): compiling them "
                    "now, about 25 s, once per machine", name, isa, e)
    try:
        from torch.utils.cpp_extension import load

        t0 = time.perf_counter()
        module = load(f"tokenmill_{name}", [str(CSRC / f"{name}.cpp")], extra_cflags=cflags(),
                      extra_include_paths=[str(CSRC)], extra_ldflags=["-fopenmp"])
        logger.info("C++ kernels %s (%s) compiled in %.1f s", name, isa,
                    time.perf_counter() - t0)
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
