"""device_current: a method run with its object's CUDA device current.

An engine may call its runner from another thread than the one that built it (the server's
engine thread, async launches), and a new thread's current CUDA device is cuda:0, where
Triton launches its kernels whatever device their tensors are on. Elsewhere (CPU) it adds
nothing.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

import torch

T = TypeVar("T")


def device_current(method: Callable[..., T]) -> Callable[..., T]:
    """`method` of an object with a `device` (torch.device), run with that device current."""
    @functools.wraps(method)
    def on_device(self: Any, *args: Any, **kwargs: Any) -> T:
        if self.device.type != "cuda":
            return method(self, *args, **kwargs)
        with torch.cuda.device(self.device):
            return method(self, *args, **kwargs)
    return on_device
