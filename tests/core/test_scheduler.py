"""Scheduler with a real KVCacheManager and a scripted runner output: exact per-request token
counts under the budget, chunked prefill, admission limits, preemption order, no leaks.
Engine-level twins of these (on a real tiny model) live in tests/models and tests/engine."""

from __future__ import annotations

import random

from tokenmill.config import SchedulerConfig
from tokenmill.core.interface import ModelRunnerOutput, SchedulerOutput
from tokenmill.core.kv_cache_manager import KVCacheManager
from tokenmill.core.request import Request, RequestStatus
from tokenmill.core.scheduler import Scheduler
from tokenmill.sampling_params import SamplingParams
from tokenmill.worker.request_states import RequestStates


def make_scheduler(num_blocks=101, block_size=16, budget=64, max_seqs=8, chunked=True):
    kv = KVCacheManager(num_blocks, block_size)
    cfg = SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_seqs,
                          enable_chunked_prefill=chunked)
    return sent_to_runner(Scheduler(cfg, kv, max_model_len=4096))


def sent_to_runner(s: Scheduler) -> Scheduler:
    """Every output of s.schedule() is also applied to `s.states`, the runner's side of the
    contract (worker/request_states.py), as a runner would."""
    s.states = RequestStates()
    schedule = s.schedule

    def schedule_and_send() -> SchedulerOutput:
        out = schedule()
        s.states.update(out)
        return out

    s.schedule = schedule_and_send
    return s


def fed(s: Scheduler, out: SchedulerOutput, i: int = 0) -> list[int]:
    """The tokens the runner feeds for out.scheduled[i]."""
    return s.states.resolve(out.scheduled[i]).token_ids


def make_request(rid: str, n_prompt: int, max_tokens: int = 4) -> Request:
    return Request(rid, [5] * n_prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                   [2], max_tokens)


def counts(out: SchedulerOutput) -> dict[str, int]:
    return {s.req_id: s.num_tokens for s in out.scheduled}


def finish_step(sched: Scheduler, out: SchedulerOutput, token: int = 7) -> list[Request]:
    runner_out = ModelRunnerOutput(
        req_ids=[s.req_id for s in out.scheduled],
        sampled_token_ids=[[token] if s.sample else [] for s in out.scheduled])
    return sched.update_from_output(out, runner_out)


def test_chunked_prefill_splits_under_budget():
    s = make_scheduler(budget=64)
    s.add_request(make_request("a", 100))
    s.add_request(make_request("b", 10))
    out = s.schedule()
    assert counts(out) == {"a": 64}
    assert not out.scheduled[0].sample and out.scheduled[0].start_pos == 0
    finish_step(s, out)
    out = s.schedule()
    assert counts(out) == {"a": 36, "b": 10}  # a finishes its prompt, b fills the rest
    assert [x.sample for x in out.scheduled] == [True, True]
    assert out.scheduled[0].start_pos == 64
    finish_step(s, out)
    out = s.schedule()
    assert counts(out) == {"a": 1, "b": 1}  # both decoding
    assert fed(s, out) == [7]


def test_no_chunking_waits_for_room():
    s = make_scheduler(budget=64, chunked=False)
    s.add_request(make_request("a", 40))
    s.add_request(make_request("b", 40))
    assert counts(s.schedule()) == {"a": 40}


def test_max_num_seqs_limits_admission():
    s = make_scheduler(budget=1000, max_seqs=2)
    for i in range(3):
        s.add_request(make_request(str(i), 5))
    assert counts(s.schedule()) == {"0": 5, "1": 5}
    assert s.num_waiting == 1


def test_preempts_most_recent_and_resumes_by_recompute():
    # 6 usable blocks of 4 tokens; three requests of 8 tokens take 2 blocks each.
    s = make_scheduler(num_blocks=7, block_size=4, budget=100)
    for rid in "abc":
        s.add_request(make_request(rid, 8, max_tokens=3))
    out = s.schedule()
    assert counts(out) == {"a": 8, "b": 8, "c": 8}
    finish_step(s, out)
    # Each now needs a 3rd block for its 9th token: none free, so c (last admitted) goes.
    out = s.schedule()
    assert out.preempted_req_ids == ["c"]
    assert counts(out) == {"a": 1, "b": 1}
    c = s.requests["c"]
    assert c.status == RequestStatus.PREEMPTED and c.num_computed_tokens == 0
    assert c.output_token_ids == [7] and list(s.waiting) == [c]
    finish_step(s, out)
    finish_step(s, s.schedule())  # a and b reach max_tokens=3 and finish
    assert s.kv.num_free_blocks == 6
    out = s.schedule()
    assert counts(out) == {"c": 9}  # prompt + its one generated token, recomputed
    assert fed(s, out) == [5] * 8 + [7]
    assert out.finished_req_ids == {"a", "b"}  # finished in the previous update


def test_finished_and_aborted_requests_free_blocks_and_are_reported():
    s = make_scheduler()
    s.add_request(make_request("a", 20, max_tokens=1))
    s.add_request(make_request("b", 20, max_tokens=5))
    out = s.schedule()
    done = finish_step(s, out)
    assert [r.request_id for r in done] == ["a", "b"]
    assert done[0].status == RequestStatus.FINISHED_LENGTH
    assert s.abort_request("b").status == RequestStatus.FINISHED_ABORTED
    assert s.abort_request("b") is None
    assert s.schedule().finished_req_ids == {"a", "b"}
    assert s.kv.num_free_blocks == 100 and not s.has_unfinished_requests()


def test_random_workload_with_aborts_leaks_nothing():
    rng = random.Random(0)
    s = make_scheduler(num_blocks=40, block_size=8, budget=96, max_seqs=16)
    submitted = 0
    steps = 0
    while submitted < 200 or s.has_unfinished_requests():
        for _ in range(rng.randint(0, 3)):
            if submitted < 200:
                s.add_request(make_request(f"r{submitted}", rng.randint(1, 120),
                                           rng.randint(1, 40)))
                submitted += 1
        out = s.schedule()
        assert out.num_scheduled_tokens <= 96
        if rng.random() < 0.15 and s.requests:
            s.abort_request(rng.choice(list(s.requests)))
        finish_step(s, out, token=rng.randint(3, 100))
        s.kv.check_integrity()
        steps += 1
        assert steps < 20000
    assert s.num_preemptions > 0  # the pool was small enough to force some
    assert s.kv.num_free_blocks == s.kv.num_usable_blocks
