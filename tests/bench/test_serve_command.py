"""`tokenmill bench serve --launch` end to end on a tiny model: it starts the server, runs
the load, and reports the server's CPU by thread (its event loop's time per server-sent
event, its other threads')."""

from __future__ import annotations

import json
import os

import pytest

from tokenmill.bench.process_cpu import ProcessCpu
from tokenmill.bench.serve_command import main


@pytest.mark.skipif(not ProcessCpu.supported(os.getpid()), reason="needs /proc")
def test_launched_server_reports_its_cpu(tiny_model, tmp_path, capsys):
    path, _ = tiny_model("llama")
    out = tmp_path / "serve"
    assert main(["--launch", "--model-path", path, "--workload", "uniform",
                 "--concurrency", "2", "--num-requests", "4", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "server CPU (tokenmill serve" in printed
    run = json.loads((tmp_path / "serve.json").read_text())["runs"][0]
    # 4 streams of 128 tokens: a chunk a step's tokens (what a slow reader has not read yet
    # coalesces: fewer on a loaded machine), a usage chunk and [DONE] each
    assert 4 * 3 <= run["events"] <= 4 * (1 + 128 + 2)
    assert run["server_loop_cpu_s"] > 0 and run["server_other_cpu_s"] > 0
    cpu_table = printed.split("server CPU (tokenmill serve")[1]
    row = next(line for line in cpu_table.splitlines() if line.startswith("c=2 "))
    assert row.split()[1] == str(run["events"])
