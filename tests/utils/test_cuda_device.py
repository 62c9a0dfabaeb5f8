"""utils/cuda_device.py: a runner method sees its own CUDA device as the current one from any
thread; on CPU the call goes through untouched."""

from __future__ import annotations

import threading

import pytest
import torch

from tokenmill.utils.cuda_device import device_current


class Holder:
    def __init__(self, device: str) -> None:
        self.device = torch.device(device)

    @device_current
    def current(self, x: int, y: int = 0) -> tuple[int, int | None]:
        """Its arguments back, and the current CUDA device (None without CUDA)."""
        return x + y, torch.cuda.current_device() if torch.cuda.is_available() else None


def test_on_cpu_the_method_runs_as_written():
    assert Holder("cpu").current(2, y=3)[0] == 5
    assert Holder.current.__doc__.startswith("Its arguments back")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_from_another_thread_the_runner_s_device_is_current():
    index = torch.cuda.device_count() - 1  # not the default one where there are two
    got = []
    thread = threading.Thread(target=lambda: got.append(Holder(f"cuda:{index}").current(1)))
    thread.start()
    thread.join()
    assert got == [(1, index)]
