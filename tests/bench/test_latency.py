"""`tokenmill bench latency` end to end on a tiny model: rounds, percentiles, JSON."""

from __future__ import annotations

import json

from tokenmill.cli import main


def test_latency_reports_every_round(tiny_model, tmp_path, capsys):
    path, _ = tiny_model("llama")
    out = tmp_path / "latency.json"
    rc = main(["bench", "latency", "--model", path, "--repeats", "2", "--warmup", "0",
               "--output-len", "12", "--json", str(out), "--llama-cpp"])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "--llama-cpp needs a .gguf model; skipped" in printed  # the optional peer
    results = json.loads(out.read_text())
    assert list(results) == ["tokenmill"]
    r = results["tokenmill"]
    assert r["runs"] == 2
    assert len(r["itl_ms_first_run"]) == 11  # 12 tokens, 11 gaps
    assert r["decode_tokens_per_s"] > 0 and 0 < r["ttft_s"] < r["e2e_s"]
    assert r["itl_p50_ms"] <= r["itl_p90_ms"] <= r["itl_p99_ms"]


def test_every_run_prefills_from_scratch(tiny_model):
    """The same prompt again must not be a prefix-cache hit: TTFT is a cold prefill."""
    from tokenmill import LLM
    from tokenmill.bench.latency import run_tokenmill_once

    path, _ = tiny_model("llama")
    llm = LLM(path)
    prompt = list(range(10, 138))
    for _ in range(3):
        run_tokenmill_once(llm, prompt, 4)
    assert llm.engine.kv.prefix_queries == 3 * 128
    assert llm.engine.kv.prefix_hits == 0
