"""What a server logs, under vLLM's flags: the periodic engine line (off with
--disable-log-stats), each request's prompt and parameters (--enable-log-requests, cut by
--max-log-len), the line per HTTP request (off with --disable-uvicorn-access-log); and the
serve command's parsing of those flags (and of vLLM's other spellings users bring)."""

from __future__ import annotations

import logging
import time

import httpx
import pytest

from tests.server.conftest import start_server
from tokenmill.cli import build_parser, main, server_logging
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.engine_args import EngineArgs
from tokenmill.server.api_server import ServerLogging


def _complete(srv, prompt: str, max_tokens: int) -> None:
    r = httpx.post(f"{srv.base_url}/v1/completions", timeout=60, json={
        "model": srv.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0})
    assert r.status_code == 200, r.text


def _lines(caplog: pytest.LogCaptureFixture, logger: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == logger]


def test_logging_flags_on_a_running_server(tiny_model, caplog):
    path, _ = tiny_model("llama")
    engine = LLMEngine.from_options(path, max_model_len=512, num_kv_blocks=200)
    log = ServerLogging(stats_interval_s=0.2, log_requests=True, max_log_len=5,
                        access_log=False)
    caplog.set_level(logging.INFO)
    for srv in start_server(engine, "tiny", log=log):
        _complete(srv, "Hello there, engine", max_tokens=6)
        deadline = time.monotonic() + 10
        while not any("Running: 0 reqs" in line
                      for line in _lines(caplog, "tokenmill.metrics.stat_logger")):
            assert time.monotonic() < deadline, "no stats line"
            time.sleep(0.05)
        srv.wait_idle()
    (request,) = _lines(caplog, "tokenmill.server.request_log")
    assert "prompt 'Hello'... (19 characters)" in request and "max_tokens=6" in request
    stats = _lines(caplog, "tokenmill.metrics.stat_logger")
    # the request's 6 tokens were generated within some logged interval
    assert any("Avg generation throughput: 0.0" not in line for line in stats), stats
    assert not _lines(caplog, "tokenmill.access")  # no access lines


def test_default_logging_has_access_lines_and_no_request_contents(tiny_server, caplog):
    caplog.set_level(logging.INFO)
    _complete(tiny_server, "private words", max_tokens=2)
    tiny_server.wait_idle()
    assert any(line.startswith("POST /v1/completions 200")
               for line in _lines(caplog, "tokenmill.access"))
    assert not _lines(caplog, "tokenmill.server.request_log")
    assert not any("private words" in r.getMessage() for r in caplog.records)


def test_serve_takes_vllm_s_flags():
    parser = build_parser()
    args = parser.parse_args([
        "serve", "m", "--disable-log-stats", "--disable-log-requests", "--max-log-len", "10",
        "--disable-uvicorn-access-log", "--uvicorn-log-level", "warning",
        "--kv-cache-memory-bytes", "1000000", "--max-cudagraph-capture-size", "64"])
    assert server_logging(args) == ServerLogging(
        log_stats=False, log_requests=False, max_log_len=10, access_log=False,
        uvicorn_log_level="warning")
    assert EngineArgs.cli_options(args) == {"kv_cache_memory": "1000000",
                                            "cuda_graph_sizes": [64]}
    on = server_logging(parser.parse_args(["serve", "m", "--enable-log-requests"]))
    assert on.log_requests and on.log_stats and on.access_log
    assert server_logging(parser.parse_args(["serve", "m"])) == ServerLogging()


def test_a_bad_logging_flag_fails_before_the_model_loads(capsys):
    # (the model path does not exist: the flag is refused first)
    handlers = logging.getLogger().handlers[:]
    assert main(["serve", "/nonexistent/model", "--max-log-len", "-1"]) == 2
    assert logging.getLogger().handlers == handlers  # (before serving's logging is set up)
    assert "max_log_len must be >= 0" in capsys.readouterr().err
