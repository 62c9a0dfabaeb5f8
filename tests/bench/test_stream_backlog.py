"""benchmarks/stream_backlog.py on the tiny Llama: stalled readers take each request's whole
answer in one read, and the line it prints says so."""

from __future__ import annotations

import re

from tokenmill.bench.stream_backlog import main


def test_a_stalled_reader_reads_each_request_once(tiny_model, capsys):
    path, _ = tiny_model("llama")
    assert main(["--model", path, "--requests", "3", "--max-tokens", "12",
                 "--logprobs", "2"]) == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    m = re.search(r"3 requests x 12 tokens, logprobs 2, delta outputs, .*held ([\d.]+) MiB; "
                  r"reads a request 1-1;", line)
    assert m is not None, line
    assert float(m.group(1)) < 16
