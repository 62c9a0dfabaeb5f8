"""benchmarks/real_shapes.py (the GPU run of random-weight models of real shapes) on CPU with a
tiny shape: it builds its model folder, loads dummy weights and reports every figure."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "real_shapes.py"


def test_real_shapes_script_on_cpu(tmp_path):
    out = tmp_path / "shapes.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--models", "tiny",
                           "--batch", "3", "--json", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "tiny       default" in proc.stdout
    (row,) = json.loads(out.read_text())["results"]
    assert row["model"] == "tiny" and row["batch"] == 3
    # the floor: the tiny shape's float32 weights (embedding tied; per layer q, k, v, o, the
    # MLP's three and two norms; the final norm) read once at the CPU's 30 GB/s
    per_layer = 64 * 64 * 2 + 64 * 32 * 2 + 3 * 64 * 128 + 2 * 64
    weight_bytes = 4 * (512 * 64 + 2 * per_layer + 64)
    assert row["floor_ms"] == pytest.approx(weight_bytes / 30e9 * 1e3)
    # the printed row is the measured one; a decode step is within a prefill's time and the
    # batch's rate is its 3 x (256 + 128) tokens over a time no shorter than one decode step
    printed = next(line for line in proc.stdout.splitlines() if line.startswith("tiny "))
    assert printed.split()[2:] == [f"{row['ttft_s']:.4f}", f"{row['decode_ms']:.3f}",
                                   f"{row['decode_ms'] / row['floor_ms']:.2f}",
                                   f"{row['total_tok_s']:.1f}"]
    assert 0 < row["decode_ms"] / 1e3 < 60 and 0 < row["ttft_s"] < 60
    assert 0 < row["total_tok_s"] <= 3 * (256 + 128) / (row["decode_ms"] / 1e3)
