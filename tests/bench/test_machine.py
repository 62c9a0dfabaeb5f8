"""What benchmarks print about the machine and their own memory: the CPU line, and a process's
peak memory that is its own, not that of the process which started it."""

from __future__ import annotations

import resource
import subprocess
import sys

from tokenmill.bench.machine import describe_machine, process_memory_mib


def test_machine_line_names_the_cpu_flags_and_threads():
    line = describe_machine()
    assert line.startswith("CPU: ") and "flags: " in line and " threads" in line


def test_a_child_s_peak_is_its_own_not_its_parent_s():
    """A child started by a large parent: ru_maxrss reports the parent's size (Linux carries it
    over fork and exec), VmHWM the child's own."""
    ballast = bytearray(600 * 2**20)  # 600 MiB, every page touched
    ballast[::4096] = b"\x01" * len(ballast[::4096])
    assert process_memory_mib("VmHWM") >= process_memory_mib("VmRSS") >= 600
    code = ("import resource; from tokenmill.bench.machine import process_memory_mib; "
            "print(process_memory_mib('VmHWM'), "
            "resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.split()
    own_peak, inherited = float(out[0]), float(out[1])
    assert 0 < own_peak < 500  # an interpreter and torch's import, not the parent's 600 MiB
    assert inherited >= 600  # what real_gguf.py used to report
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 >= 600
    del ballast
