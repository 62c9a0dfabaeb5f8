"""benchmarks/gguf_kernels.py on a small shape: it builds random blocks of each type it is
given, times them and prints a line per row count with a figure for every type."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tokenmill.layers import cpu_ops

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gguf_kernels.py"


@pytest.mark.skipif(not cpu_ops.ops_available(), reason="C++ toolchain unavailable")
def test_gguf_kernels_script_reports_every_type_and_row_count():
    proc = subprocess.run([sys.executable, str(SCRIPT), "--types", "Q4_K,Q5_0", "--rows", "1",
                           "3", "--shape", "64x512", "--copies", "2", "--rounds", "1"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "CPU:" in proc.stdout and "GB/s" in proc.stdout
    rows = {int(m.group(1)): m.group(2) for m in
            re.finditer(r"^\s+(\d+)((?:\s+[\d.]+ \([\d.]+\)){2})\s*$", proc.stdout, re.M)}
    assert sorted(rows) == [1, 3], proc.stdout
