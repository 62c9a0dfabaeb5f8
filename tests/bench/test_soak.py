"""The soak benchmark, short: good, bad and client-aborted requests against a real server in
this process; it must find no 5xx, no truncated stream, gauges back at zero and every block
free — and it must be able to fail."""

from __future__ import annotations

from tokenmill.bench.soak import SoakReport, check_idle, soak


def test_short_soak_passes(tiny_model):
    path, _ = tiny_model("llama")
    report = soak(path, num_requests=160, concurrency=16, seed=1,
                  engine_options={"max_model_len": 512, "num_kv_blocks": 300},
                  progress=False)
    assert report.ok, report.problems
    assert report.good > 80 and report.bad > 10 and report.aborted > 10
    assert not any(isinstance(k, int) and k >= 500 for k in report.statuses)
    assert sum(v for k, v in report.statuses.items() if k in (400, 404, 405)) >= report.bad


def test_check_idle_reports_leaked_blocks(tiny_model):
    """The end-of-soak check is not a formality: blocks taken from the pool and never given
    back are reported, by the free count and by the integrity check."""
    from tests.server.conftest import start_server
    from tokenmill.engine.llm_engine import LLMEngine

    path, _ = tiny_model("llama")
    engine = LLMEngine.from_options(path, max_model_len=128, num_kv_blocks=32)
    for srv in start_server(engine, "x"):
        report = SoakReport()
        check_idle(srv.base_url, engine, report, timeout=1)
        assert report.ok, report.problems
        engine.kv.pool.get_new_blocks(3)  # a leak
        check_idle(srv.base_url, engine, report, timeout=0.5)
        assert any("3 KV blocks still in use" in p for p in report.problems)
        assert any("integrity" in p for p in report.problems)
