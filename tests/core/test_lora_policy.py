"""The scheduler's LoRA policy (core/lora_policy.py) on the real scheduler and KV manager: a step
never holds more than max_loras adapters, requests of running adapters fill the batch past a
waiting one, and the waiting one is never starved by later arrivals."""

from __future__ import annotations

from tokenmill.config import SchedulerConfig
from tokenmill.core.interface import ModelRunnerOutput
from tokenmill.core.kv_cache_manager import KVCacheManager
from tokenmill.core.request import Request
from tokenmill.core.scheduler import Scheduler
from tokenmill.lora.request import AdapterRef
from tokenmill.sampling_params import SamplingParams

ADAPTERS = {name: AdapterRef(name, i + 1, f"/adapters/{name}", f"key-{name}", 8)
            for i, name in enumerate("ABCD")}


def _request(rid: str, adapter: str | None, max_tokens: int = 4) -> Request:
    return Request(rid, [5, 6, 7], SamplingParams(max_tokens=max_tokens, ignore_eos=True), [2],
                   max_tokens, lora=None if adapter is None else ADAPTERS[adapter])


def _scheduler(max_loras: int, max_num_seqs: int = 16) -> Scheduler:
    return Scheduler(SchedulerConfig(max_num_seqs=max_num_seqs), KVCacheManager(256, 4),
                     max_model_len=64, max_loras=max_loras)


def _step(s: Scheduler) -> list[str]:
    """One step, every sampling request given token 9; the ids it scheduled."""
    out = s.schedule()
    ids = [step.req_id for step in out.scheduled]
    s.update_from_output(out, ModelRunnerOutput(
        req_ids=ids, sampled_token_ids=[[9] if st.sample else [] for st in out.scheduled]))
    return ids


def _adapters(s: Scheduler, ids: list[str]) -> set[str]:
    return {s.requests[i].lora.name for i in ids if i in s.requests and s.requests[i].lora}


def test_a_step_holds_at_most_max_loras_adapters_and_fills_with_running_ones():
    s = _scheduler(max_loras=2)
    for i, name in enumerate(["A", "B", "C", "A", None, "B", "D"]):
        s.add_request(_request(f"r{i}", name))
    first = s.schedule()
    ids = [st.req_id for st in first.scheduled]
    # C and D wait; the later A and B requests and the base request pass them
    assert ids == ["r0", "r1", "r3", "r4", "r5"]
    assert {s.requests[i].lora.name for i in ids if s.requests[i].lora} == {"A", "B"}
    s.update_from_output(first, ModelRunnerOutput(req_ids=ids,
                                                  sampled_token_ids=[[9] for _ in ids]))
    seen: set[str] = set()
    while s.has_unfinished_requests():
        ids = _step(s)
        running = {r.lora.name for r in s.running if r.lora}
        assert len(running) <= 2
        seen |= {i for i in ids}
    assert {"r2", "r6"} <= seen


def test_a_waiting_adapter_is_not_starved_by_later_arrivals():
    """Requests of the running adapter keep arriving; the waiting adapter starts once the work
    queued before it is done."""
    s = _scheduler(max_loras=1)
    s.add_request(_request("a0", "A", max_tokens=3))
    assert _step(s) == ["a0"]
    s.add_request(_request("b0", "B"))
    for step in range(1, 40):
        s.add_request(_request(f"a{step}", "A", max_tokens=3))  # a new A request every step
        ids = _step(s)
        if "b0" in ids:
            break
        assert len(_adapters(s, ids)) <= 1
    else:
        raise AssertionError("B never started")
    assert step <= 4  # waited for a0 (and the A requests queued before b0 was passed over)


def test_without_an_adapter_limit_base_requests_are_plain_fcfs():
    s = _scheduler(max_loras=1, max_num_seqs=2)
    for i in range(3):
        s.add_request(_request(f"r{i}", None))
    assert _step(s) == ["r0", "r1"]
