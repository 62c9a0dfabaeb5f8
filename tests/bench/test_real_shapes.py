"""benchmarks/real_shapes.py (the GPU run of random-weight models of real shapes) on CPU with a
tiny shape: it builds its model folder, loads dummy weights and reports every figure."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

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
    assert row["ttft_s"] > 0 and row["decode_ms"] > 0 and row["total_tok_s"] > 0
    assert row["floor_ms"] > 0
