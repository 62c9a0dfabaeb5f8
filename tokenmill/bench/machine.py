"""One line describing the machine a benchmark ran on, printed beside its figures: figures
only compare within one run, and only on the CPU they name."""

from __future__ import annotations

import platform

import torch

from tokenmill.utils.cpp_extension import cpu_flags, cpuinfo_field

_FLAGS_OF_INTEREST = ("avx2", "fma", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16",
                      "avx512_fp16", "avx_vnni", "amx_tile", "amx_bf16", "amx_int8")


def describe_machine() -> str:
    model = cpuinfo_field("model name") or platform.processor() or platform.machine()
    flags = cpu_flags()
    shown = " ".join(f for f in _FLAGS_OF_INTEREST if f in flags) or "n/a"
    return (f"CPU: {model}; flags: {shown}; torch {torch.__version__} "
            f"{torch.backends.cpu.get_cpu_capability()}, {torch.get_num_threads()} threads")


def process_memory_mib(field: str = "VmRSS") -> float:
    """This process's memory from /proc/self/status in MiB: "VmRSS" now, "VmHWM" its peak (0.0
    where /proc is absent). The peak is VmHWM, not getrusage's ru_maxrss: Linux carries
    ru_maxrss over fork and exec, so a child started by a large parent reports the parent's
    size (an 8B benchmark's children reported its 18.5 GiB file-writing parent)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0
