"""The C heap under CPU steps: glibc's malloc told to keep what a step frees for the next one.

A CPU step allocates its activations afresh in every layer (torch's outputs, the GGUF kernels'
int16 rows of x): 8-128 MB each in a 2,048-token prefill of a 1B model, ~375 MB per layer in
all. glibc's defaults hand much of that back to the OS at every free: blocks above its mmap
threshold (dynamic, at most 32 MiB) are mapped and unmapped per allocation, the heap's top is
trimmed above 2x that, and a thread other than the main one (the server's engine thread)
allocates from an arena of 64 MiB heaps, mapping anything larger on its own and unmapping a
heap when it empties. Every page handed back faults in zeroed on its next use: 1.5 million
faults (~6 GB zeroed) per such prefill step measured, 5-10% of its time (benchmarks/
RESULTS.md, forty-fourth session).

- `share_main_arena()`, at `import tokenmill`: M_ARENA_MAX 1, so that threads started later
  (the engine's) allocate from the main arena, whose heap grows contiguously. It must come
  before other threads take arenas of their own: glibc hands a new thread an arena that an
  exited thread left before it applies the limit.
- `keep_step_memory()`, once a CPU engine has loaded: M_MMAP_THRESHOLD 1 GiB (blocks below it
  come from the heap, not fresh mappings) and M_TRIM_THRESHOLD "never" (free memory at the
  heap's top stays: the next step of the same size reaches the same peak).
- `returning_freed_memory()`, around a load under that policy (another engine in the process,
  a wake from sleep mode): glibc's initial thresholds (128 KiB), so that a load's temporaries
  go back to the OS as they are freed, and its peak stays what it was for the first engine.
- `trim_heap()`: malloc_trim, where the engine frees something for good (after loading, sleep).

What this costs: memory a step freed stays mapped (resident at the heaviest step's level, as
under vLLM's tcmalloc advice). `TOKENMILL_KEEP_HEAP=0` leaves glibc's defaults. Not glibc (musl,
macOS): nothing to set, nothing set.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import logging
import os
from collections.abc import Iterator

logger = logging.getLogger(__name__)

# mallopt's parameter numbers (glibc's malloc.h)
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
M_ARENA_MAX = -8

MMAP_THRESHOLD = 1 << 30
TRIM_THRESHOLD = (1 << 31) - 1  # mallopt takes an int: "never" in practice
LOAD_THRESHOLD = 128 << 10  # glibc's initial mmap and trim thresholds
KEEP = ((M_MMAP_THRESHOLD, MMAP_THRESHOLD), (M_TRIM_THRESHOLD, TRIM_THRESHOLD))

_libc: ctypes.CDLL | None | bool = False  # False: not looked up yet; None: not glibc
_kept = False


def _glibc() -> ctypes.CDLL | None:
    global _libc
    if _libc is False:
        try:
            lib = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
            lib.mallopt, lib.malloc_trim  # noqa: B018 (glibc has both)
            _libc = lib
        except (OSError, AttributeError):
            _libc = None
    return _libc


def _enabled() -> ctypes.CDLL | None:
    return None if os.environ.get("TOKENMILL_KEEP_HEAP", "1") == "0" else _glibc()


def _set(*settings: tuple[int, int]) -> bool:
    lib = _enabled()
    if lib is None:
        return False
    ok = all(lib.mallopt(param, value) == 1 for param, value in settings)
    if not ok:
        logger.debug("glibc refused a mallopt setting: steps may fault freed memory back in")
    return ok


def share_main_arena() -> bool:
    """Threads started from now on allocate from the main arena (the module docstring)."""
    return _set((M_ARENA_MAX, 1))


def keep_step_memory() -> bool:
    """Keep freed memory in the process for the next step. Returns whether it is kept (False:
    not glibc, or TOKENMILL_KEEP_HEAP=0)."""
    global _kept
    if not _kept:
        _kept = _set(*KEEP)
    return _kept


@contextlib.contextmanager
def returning_freed_memory() -> Iterator[None]:
    """Inside: what is freed goes back to the OS (glibc's initial thresholds), if an engine
    had set keep_step_memory(); after: kept again."""
    if not _kept:
        yield
        return
    _set((M_MMAP_THRESHOLD, LOAD_THRESHOLD), (M_TRIM_THRESHOLD, LOAD_THRESHOLD))
    try:
        yield
    finally:
        _set(*KEEP)


def trim_heap() -> None:
    """glibc's malloc_trim(0): return the heap's free pages to the OS (a no-op elsewhere)."""
    lib = _glibc()
    if lib is not None:
        lib.malloc_trim(0)
