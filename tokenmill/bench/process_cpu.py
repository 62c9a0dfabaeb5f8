"""CPU time of another process's threads, from Linux's /proc: what a launched server spends on
its event loop (the main thread, where uvicorn runs it) against its other threads (the engine
thread, OpenMP's workers, the tokenizer pool), around a benchmark run.

Invariant: a thread is keyed by its id; one that started during the run counts from zero, one
that ended during it counts nothing (its time is gone with it): `ProcessCpu.between` is a
lower bound for the other threads, exact for the main thread, which lives as long as the
process.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def thread_cpu_seconds(pid: int) -> dict[int, float]:
    """{thread id: user + system CPU seconds so far} of process `pid`'s live threads."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                stat = f.read()
        except FileNotFoundError:  # it ended since the listing
            continue
        # fields after the command (which may hold spaces): state is field 3, utime 14, stime 15
        fields = stat[stat.rindex(")") + 2:].split()
        out[int(tid)] = (int(fields[11]) + int(fields[12])) / _TICKS
    return out


@dataclass
class ProcessCpu:
    main_s: float  # the main thread's CPU seconds (a server's event loop)
    others_s: float  # every other thread's

    @staticmethod
    def between(pid: int, before: dict[int, float], after: dict[int, float]) -> ProcessCpu:
        """CPU spent between two `thread_cpu_seconds(pid)` snapshots."""
        spent = {tid: t - before.get(tid, 0.0) for tid, t in after.items()}
        main = spent.pop(pid, 0.0)
        return ProcessCpu(main, sum(spent.values()))

    @classmethod
    def supported(cls, pid: int) -> bool:
        return os.path.isdir(f"/proc/{pid}/task")
