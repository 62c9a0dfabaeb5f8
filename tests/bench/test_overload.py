"""The overload benchmark, small: 40 simultaneous requests against a server admitting 4 + 4
sequences; the surplus gets 429 with Retry-After, every admitted request completes, and
/health was probed throughout."""

from __future__ import annotations

import asyncio

from tests.server.conftest import start_server
from tokenmill.bench.overload import format_result, overload
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.server.api_server import ServerLimits


def test_overload_run(tiny_model):
    path, _ = tiny_model("llama")
    engine = LLMEngine.from_options(path, max_model_len=512, num_kv_blocks=200, max_num_seqs=4)
    for srv in start_server(engine, "m", limits=ServerLimits(max_waiting_requests=4)):
        r = asyncio.run(overload(srv.base_url, 40, max_tokens=64))
        assert set(r.statuses) == {200, 429}
        assert 8 <= r.statuses[200] < 40 and r.statuses[200] + r.statuses[429] == 40
        assert r.retry_after == {"1"} and r.health_s
        assert "queue bound 4" in format_result(r, 40, 4)
        srv.wait_idle()
