"""Where a CUDA step makes the host wait for the device, counted by the line that asked.

torch's sync debug mode (`torch.cuda.set_sync_debug_mode("warn")`) makes every synchronizing
CUDA call (`.item()`, `.tolist()`, a copy into pageable memory, `nonzero`, ...) raise a
UserWarning from the Python line that made it. `HostSyncs` turns the mode on for a block,
takes those warnings (they are not printed) and counts them by their innermost frame inside
the given source roots (tokenmill's package by default), so a profile can say "3 syncs a step:
2 at worker/model_runner.py:412, 1 at ...". Other warnings pass through unchanged, and the
mode and the warning filters are restored on exit.

On a machine without CUDA it counts nothing unless `mode_on=False` names that the caller
raises the warnings itself (tests: the attribution is the same code either way).
"""

from __future__ import annotations

import collections
import os
import traceback
import warnings
from collections.abc import Sequence

import torch

# the text of torch's warning (c10/cuda/CUDAFunctions.h: warn_or_error_on_sync)
SYNC_MESSAGE = "called a synchronizing CUDA operation"
PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUTSIDE = "(outside the roots)"


class HostSyncs:
    """Counts synchronizing CUDA calls made inside the `with` block, by call site:
    `sites` maps "path:line function" (path relative to its root's parent) to a count."""

    def __init__(self, roots: Sequence[str] = (PACKAGE_ROOT,), mode_on: bool | None = None):
        self.roots = [os.path.abspath(r) for r in roots]
        self.mode_on = torch.cuda.is_available() if mode_on is None else mode_on
        self.sites: collections.Counter[str] = collections.Counter()
        self._this_file = os.path.abspath(__file__)

    @property
    def total(self) -> int:
        return sum(self.sites.values())

    def __enter__(self) -> HostSyncs:
        self._filters = warnings.catch_warnings()
        self._filters.__enter__()
        # "always": the warnings module would otherwise show a site once and drop the rest
        warnings.filterwarnings("always", message=SYNC_MESSAGE)
        self._show = warnings.showwarning
        warnings.showwarning = self._record
        if self.mode_on:
            self._previous_mode = torch.cuda.get_sync_debug_mode()
            torch.cuda.set_sync_debug_mode("warn")
        return self

    def __exit__(self, *exc: object) -> None:
        if self.mode_on:
            torch.cuda.set_sync_debug_mode(self._previous_mode)
        self._filters.__exit__(*exc)  # restores showwarning and the filters

    def _record(self, message, category, filename, lineno, file=None, line=None) -> None:
        if SYNC_MESSAGE not in str(message):
            self._show(message, category, filename, lineno, file, line)
            return
        self.sites[self._site(traceback.extract_stack())] += 1

    def _site(self, stack: list[traceback.FrameSummary]) -> str:
        for frame in reversed(stack):  # innermost first
            path = os.path.abspath(frame.filename)
            if path == self._this_file:
                continue
            for root in self.roots:
                if path.startswith(root + os.sep):
                    rel = os.path.relpath(path, os.path.dirname(root))
                    return f"{rel}:{frame.lineno} {frame.name}"
        return OUTSIDE
