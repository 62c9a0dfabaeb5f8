"""The priority scheduling policy on the real scheduler with a scripted runner: the waiting
queue in (priority, arrival) order, returning requests ahead of their equals, the lowest
priority preempted first when KV runs out, a full batch giving up its lowest-priority request
to a more urgent one, and fcfs unchanged."""

from __future__ import annotations

import pytest

from tests.core.test_scheduler import finish_step, sent_to_runner
from tokenmill.config import SchedulerConfig
from tokenmill.core.kv_cache_manager import KVCacheManager
from tokenmill.core.request import Request, RequestStatus
from tokenmill.core.scheduler import Scheduler
from tokenmill.core.scheduling_policy import PriorityQueue, SchedulingPolicy
from tokenmill.sampling_params import SamplingParams


def req(rid: str, priority: int, arrival: float, n_prompt: int = 8, max_tokens: int = 4
        ) -> Request:
    return Request(rid, [5] * n_prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                   [2], max_tokens, arrival_time=arrival, priority=priority)


def scheduler(policy: str, num_blocks: int = 101, max_seqs: int = 8) -> Scheduler:
    cfg = SchedulerConfig(max_num_batched_tokens=256, max_num_seqs=max_seqs,
                          scheduling_policy=policy)
    return sent_to_runner(Scheduler(cfg, KVCacheManager(num_blocks, 4), max_model_len=512))


def test_the_queue_orders_by_priority_then_arrival():
    q = PriorityQueue()
    for r in [req("c", 1, 3.0), req("a", 0, 2.0), req("d", 1, 1.0), req("b", 0, 5.0)]:
        q.append(r)
    assert [r.request_id for r in q] == ["a", "b", "d", "c"]
    q.appendleft(req("back", 1, 1.0))  # a returning request goes ahead of its equals
    q.append(req("late", 1, 1.0))
    assert [r.request_id for r in q] == ["a", "b", "back", "d", "late", "c"]
    assert isinstance(SchedulingPolicy("fcfs").new_queue(), type(q).__base__)
    with pytest.raises(ValueError, match="scheduling_policy"):
        SchedulingPolicy("lifo")


def test_kv_shortage_preempts_the_lowest_priority_first():
    s = scheduler("priority", num_blocks=8)  # 7 blocks of 4 tokens: not both to the end
    urgent, lax = req("urgent", 0, 2.0, max_tokens=8), req("lax", 5, 1.0, max_tokens=8)
    for r in (lax, urgent):
        s.add_request(r)
    out = s.schedule()
    assert [x.req_id for x in out.scheduled] == ["urgent", "lax"]  # priority before arrival
    while urgent.status == RequestStatus.RUNNING and lax.status == RequestStatus.RUNNING:
        finish_step(s, out)
        out = s.schedule()
    assert lax.status == RequestStatus.PREEMPTED and lax.num_preemptions == 1
    assert urgent.num_preemptions == 0


def test_a_full_batch_makes_room_for_a_more_urgent_request():
    s = scheduler("priority", max_seqs=2)
    lows = [req(f"low{i}", 3, float(i), max_tokens=50) for i in range(3)]
    for r in lows:
        s.add_request(r)
    finish_step(s, s.schedule())
    assert [r.request_id for r in s.running] == ["low0", "low1"]
    s.add_request(req("high", 0, 9.0, max_tokens=50))
    out = s.schedule()
    assert out.preempted_req_ids == ["low1"]  # the latest of the lowest priority
    finish_step(s, out)
    out = s.schedule()
    assert "high" in [x.req_id for x in out.scheduled]
    assert [r.request_id for r in s.waiting] == ["low1", "low2"]
    same = req("same", 3, 10.0)  # no more urgent than the running: it waits its turn
    s.add_request(same)
    finish_step(s, out)
    assert not s.schedule().preempted_req_ids


def test_fcfs_ignores_priority_order():
    s = scheduler("fcfs", max_seqs=1)
    s.add_request(req("first", 9, 1.0))
    s.add_request(req("second", 0, 2.0))
    assert [x.req_id for x in s.schedule().scheduled] == ["first"]
