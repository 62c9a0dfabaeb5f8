"""tokenmill/bench/offline.py, the sharegpt workload, and benchmarks/offline_throughput.py on CPU
with the tiny shape (the GPU session runs it on the 8B shape)."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path

from tests.conftest import assert_kv_all_free
from tokenmill.bench.offline import run_engine
from tokenmill.bench.workloads import SHAREGPT_OUTPUT, SHAREGPT_PROMPT, make_workload

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "offline_throughput.py"


def test_sharegpt_workload_is_seeded_bounded_and_long_tailed():
    reqs = make_workload("sharegpt", 1000, {0, 1, 2})
    assert len(reqs) == 1000
    assert reqs == make_workload("sharegpt", 1000, {0, 1, 2})  # the same every run
    assert reqs != make_workload("sharegpt", 1000, {0, 1, 2}, seed=1)
    prompts = [len(r.prompt_token_ids) for r in reqs]
    outputs = [r.output_len for r in reqs]
    assert SHAREGPT_PROMPT[2] <= min(prompts) and max(prompts) <= SHAREGPT_PROMPT[3] == 1024
    assert SHAREGPT_OUTPUT[2] <= min(outputs) and max(outputs) <= SHAREGPT_OUTPUT[3] == 512
    assert not {0, 1, 2} & {t for r in reqs for t in r.prompt_token_ids}
    # ShareGPT's shape: means near 240 / 185 tokens, a mean well above the median (a long
    # tail), and requests at both ends
    assert 200 < statistics.mean(prompts) < 280 and 160 < statistics.mean(outputs) < 210
    assert statistics.mean(prompts) > 1.3 * statistics.median(prompts)
    assert sum(p < 32 for p in prompts) > 10 and sum(p > 768 for p in prompts) > 10


def test_run_engine_times_every_token(tiny_model):
    from tokenmill import LLM

    folder, _ = tiny_model("llama")
    llm = LLM(folder, max_num_seqs=4)
    reqs = [r for r in make_workload("sharegpt", 512, {0, 1, 2}, num_requests=40)
            if len(r.prompt_token_ids) + r.output_len <= 512][:9]  # the model's context
    result = run_engine(llm.engine, reqs)
    assert result.output_tokens == sum(r.output_len for r in reqs)
    assert result.total_tokens == result.output_tokens + sum(len(r.prompt_token_ids)
                                                             for r in reqs)
    # one TTFT per request, one ITL per token after each request's first
    assert len(result.ttft_s) == 9
    assert len(result.itl_s) == sum(r.output_len - 1 for r in reqs)
    assert all(0 < t < result.seconds for t in result.ttft_s)
    assert all(x >= 0 for x in result.itl_s)
    # 4 sequences at a time: the last requests wait for a place, so their first token comes
    # after the first request's has
    assert max(result.ttft_s) > min(result.ttft_s)
    assert llm.engine.outputs.timings is None  # the engine's own observer is put back
    assert_kv_all_free(llm.engine)


def test_offline_throughput_script_on_cpu(tmp_path):
    out = tmp_path / "offline.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--model", "tiny", "--device", "cpu",
                           "--num-requests", "12", "--hf-reference", "--hf-batch-size", "4",
                           "--json", str(out)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    summary = json.loads(out.read_text())
    assert summary["workload"] == "sharegpt" and summary["num_requests"] == 12
    assert summary["model"] == "tiny"
    reqs = make_workload("sharegpt", 512, {0, 1, 2}, num_requests=12)
    output_tokens = sum(r.output_len for r in reqs)
    total = output_tokens + sum(len(r.prompt_token_ids) for r in reqs)
    assert f"12 requests, {total - output_tokens} prompt + {output_tokens} output" in proc.stdout
    for name in ("tokenmill", "hf static bs4"):
        r = summary["results"][name]
        # the rates are the workload's tokens over the measured time
        assert abs(r["output_tokens_per_s"] * r["seconds"] - output_tokens) < 1e-6 * total
        assert abs(r["total_tokens_per_s"] * r["seconds"] - total) < 1e-6 * total
        assert 0 < r["ttft_p50_ms"] <= r["ttft_p99_ms"] <= r["seconds"] * 1e3
        assert 0 <= r["itl_p50_ms"] <= r["itl_p99_ms"]
        printed = next(line for line in proc.stdout.splitlines() if line.startswith(name))
        assert f"{r['output_tokens_per_s']:.1f}" in printed
    ratio = (summary["results"]["tokenmill"]["output_tokens_per_s"]
             / summary["results"]["hf static bs4"]["output_tokens_per_s"])
    assert f"{ratio:.2f}x output tok/s" in proc.stdout
