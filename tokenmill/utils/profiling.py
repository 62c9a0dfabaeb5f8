"""Named profiler scopes that cost nothing when no profiler is running.

`torch.profiler.record_function` costs several microseconds per use even with profiling off,
which adds up at one scope per layer per step; `scope` checks first.
"""

from __future__ import annotations

import contextlib
from contextlib import AbstractContextManager

import torch.autograd.profiler as autograd_profiler
from torch.profiler import record_function

_NULL = contextlib.nullcontext()


def scope(name: str) -> AbstractContextManager[object]:
    """A `record_function(name)` while a profiler runs, else a shared no-op context."""
    if autograd_profiler._is_profiler_enabled:
        return record_function(name)
    return _NULL
