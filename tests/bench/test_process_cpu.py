"""A process's CPU by thread, from /proc: a busy thread's time is its own, the main thread
is told apart from the others, and a thread that ends between snapshots is not counted."""

from __future__ import annotations

import os
import threading
import time

import pytest

from tokenmill.bench.process_cpu import ProcessCpu, thread_cpu_seconds

pytestmark = pytest.mark.skipif(not ProcessCpu.supported(os.getpid()), reason="needs /proc")


def _spin(seconds: float) -> None:
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def test_busy_main_thread_counts_as_main():
    before = thread_cpu_seconds(os.getpid())
    _spin(0.4)
    cpu = ProcessCpu.between(os.getpid(), before, thread_cpu_seconds(os.getpid()))
    assert cpu.main_s >= 0.3 and cpu.others_s < 0.2


def test_busy_other_thread_counts_as_other():
    pid = os.getpid()
    spun, stop = threading.Event(), threading.Event()

    def worker() -> None:  # spins, then stays alive (blocked) until read
        _spin(0.4)
        spun.set()
        stop.wait()

    t = threading.Thread(target=worker)
    before = thread_cpu_seconds(pid)
    t.start()
    try:
        assert spun.wait(timeout=30)  # the main thread blocks meanwhile
        cpu = ProcessCpu.between(pid, before, thread_cpu_seconds(pid))
    finally:
        stop.set()
        t.join()
    assert cpu.others_s >= 0.3 and cpu.main_s < 0.2


def test_threads_gone_count_nothing_and_new_ones_from_zero():
    pid = os.getpid()
    before = {pid: 1.0, 999_999_999: 5.0}  # a thread that has ended since
    after = {pid: 1.5, 123: 0.25}  # one that started since
    cpu = ProcessCpu.between(pid, before, after)
    assert cpu.main_s == pytest.approx(0.5) and cpu.others_s == pytest.approx(0.25)
