"""benchmarks/profile_step.py on CPU with a shape name (random weights of a real shape's config,
the way benchmarks/gpu_session.sh runs it on the GPU): the scopes it reports are the steps' and
add up to the profiled time, and a CPU run reports no device time."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "profile_step.py"
SCOPES = ["schedule", "prepare_inputs", "forward", "logits", "sample", "process_outputs"]


def test_profile_step_script_on_a_shape(tmp_path):
    out = tmp_path / "profile.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--model", "tiny", "--device", "cpu",
                           "--scenario", "decode64", "--steps", "2", "--ops", "3",
                           "--enforce-eager", "--json", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    [result] = json.loads(out.read_text())
    assert result["scenario"] == "decode64" and result["wall_ms_per_step"] > 0
    scopes = result["profiled_ms_per_step"]
    assert scopes["forward"] > 0 and scopes["sample"] > 0
    # forward's parts are forward's time, split (the rest is what the named parts leave)
    parts = ("forward.gemm", "forward.attention", "forward.fused_layers", "forward.other")
    assert abs(sum(scopes[p] for p in parts) - scopes["forward"]) < 1e-6 * scopes["forward"]
    assert result["device_ms_per_step"] == 0 and result["top_kernels_ms_per_step"] == {}
    assert result["device_ops_per_step"] == 0
    assert result["host_syncs_per_step"] is None  # CUDA only
    assert len(result["top_ops_ms_per_step"]) > 3
    total = sum(scopes[s] for s in SCOPES)
    assert f"profiled scopes {total:.1f} ms" in proc.stdout
    assert "ops by self time (host):" in proc.stdout and "kernels by device time" not in proc.stdout
    assert "host waits for the device" not in proc.stdout
