"""Another version of the CPU kernels, built beside the installed ones, for in-process A/B runs.

A kernel change is measured end to end by running the same engine's steps with the old and
the new kernels in turn (bench/alternate.py), in one process: runs of the engine in separate
processes moved by 20-30% within minutes on the development machines, more than most kernel
changes (benchmarks/RESULTS.md, fifty-first and fifty-second sessions).

`build_kernels(csrc)` compiles another checkout's csrc folder
(`git archive REV tokenmill/csrc | tar -x -C /tmp/old` gives /tmp/old/tokenmill/csrc) under
module names of its own; `using_kernels(built)` makes the engine's CPU steps call them until
it exits. What is swapped: `cpu_ops` (every fused op and linear kernel the modules call) and
`decode_layers_cpu` (the fused decode call, the attention kernel compiled into it). The weights
stay as the installed build packed them, so the two versions must share their packed layouts.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from torch.utils.cpp_extension import load

import tokenmill.layers.cpu_ops as cpu_ops
import tokenmill.models.cpu_decode as cpu_decode
from tokenmill.utils.cpp_extension import cflags

# the modules swapped, and the function of each that the engine asks for its module
SWAPPED = ("cpu_ops", "decode_layers_cpu")


# GCC makes a static local of an inline function (the kernels' per-thread scratch buffers,
# `static thread_local` in their headers) a GNU unique symbol, which the dynamic loader binds
# to one definition per process even across modules loaded with RTLD_LOCAL: a second build
# whose struct has another layout then used the first one's buffers (the fifty-third
# session's attention A/B: NaN from the old build after the new had run). Its own copies here.
ISOLATING_FLAGS = ["-fno-gnu-unique"]


def build_module(source: str | Path, include: str | Path, prefix: str) -> Any:
    """`source` (a .cpp, its headers in `include`) compiled as a module of its own, named by
    its sources and flags: it shares no symbol with the installed build or another version."""
    include = Path(include)
    flags = cflags() + ISOLATING_FLAGS
    text = (Path(source).read_bytes() + " ".join(flags).encode()
            + b"".join(h.read_bytes() for h in sorted(include.glob("*.h"))))
    digest = hashlib.sha256(text).hexdigest()[:10]
    return load(f"{prefix}_{digest}", [str(source)], extra_cflags=flags,
                extra_include_paths=[str(include)], extra_ldflags=["-fopenmp"])


def build_kernels(csrc: str | Path) -> dict[str, Any]:
    """The modules of SWAPPED compiled from `csrc` (a csrc folder), named by its contents."""
    csrc = Path(csrc)
    return {name: build_module(csrc / f"{name}.cpp", csrc, f"{name}_bench") for name in SWAPPED}


@contextlib.contextmanager
def using_kernels(built: dict[str, Any]) -> Iterator[None]:
    """The engine's CPU kernels are `built`'s (build_kernels) inside the block."""
    saved = cpu_ops._ops, cpu_decode._module
    cpu_ops._ops = lambda: built["cpu_ops"]
    cpu_decode._module = lambda: built["decode_layers_cpu"]
    try:
        yield
    finally:
        cpu_ops._ops, cpu_decode._module = saved
