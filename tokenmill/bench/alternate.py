"""Timing several ways of doing the same work in alternation, the way every CPU benchmark here
compares paths: this machine's speed drifts by up to 1.7x within an hour, so each round times
every way back to back and only the medians over rounds, taken in one run, are compared.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping
from typing import Any


def alternate(fns: Mapping[str, Callable[[], Any]], rounds: int, calls: int,
              warmup: int = 1) -> dict[str, float]:
    """Median seconds per call of each function. Each of `rounds` rounds runs every function
    in turn: `warmup` untimed calls, then `calls` timed back to back."""
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            for _ in range(warmup):
                fn()
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            samples[name].append((time.perf_counter() - start) / calls)
    return {name: statistics.median(s) for name, s in samples.items()}
