"""The scheduler → runner contract as a diff (core/runner_view.py, worker/request_states.py):
after every step the runner's copy of each scheduled request equals the scheduler's, under
chunked prefill, preemption (recompute and swap), parallel samples sharing blocks (copy on
write) and prefix-cache hits; a decode step's message does not grow with the context."""

from __future__ import annotations

import pickle
import random
from collections.abc import Callable

import pytest

from tokenmill.config import SchedulerConfig
from tokenmill.core.interface import CachedRequestData, ModelRunnerOutput, SchedulerOutput
from tokenmill.core.kv_cache_manager import KVCacheManager
from tokenmill.core.request import Request
from tokenmill.core.scheduler import Scheduler
from tokenmill.sampling_params import SamplingParams
from tokenmill.worker.request_states import RequestStates


def scheduler(mode: str = "recompute", num_blocks: int = 40, budget: int = 48,
              sliding_window: int | None = None) -> Scheduler:
    kv = KVCacheManager(num_blocks, 4, enable_prefix_caching=True,
                        num_swap_blocks=64 if mode == "swap" else 0,
                        sliding_window=sliding_window)
    cfg = SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=8,
                          preemption_mode=mode)
    return Scheduler(cfg, kv, max_model_len=512)


def request(rid: str, prompt: list[int], max_tokens: int, n: int = 1) -> list[Request]:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    return [Request(rid if n == 1 else f"{i}_{rid}", prompt, params, [2], max_tokens)
            for i in range(n)]


def run_and_check(s: Scheduler, rng: random.Random) -> int:
    """Run s to completion, checking the runner's copy after each step; the number of steps."""
    states, steps = RequestStates(), 0
    while s.has_unfinished_requests():
        out = pickle.loads(pickle.dumps(s.schedule()))  # as a worker process receives it
        states.update(out)
        for step in out.scheduled:
            mine, theirs = states.requests[step.req_id], s.requests[step.req_id]
            assert mine.prompt_token_ids + mine.output_token_ids == theirs.all_token_ids
            assert mine.block_ids == s.kv.get_block_ids(step.req_id)
            fed = states.resolve(step).token_ids
            assert fed == theirs.all_token_ids[step.start_pos:step.start_pos
                                                + step.num_new_tokens]
        assert set(states.requests) <= set(s.requests)  # finished / preempted are dropped
        s.update_from_output(out, ModelRunnerOutput(
            [r.req_id for r in out.scheduled],
            [[rng.randrange(3, 100)] if r.sample else [] for r in out.scheduled]))
        steps += 1
    return steps


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_runner_copy_follows_the_scheduler_under_pressure(mode):
    rng = random.Random(0)
    s = scheduler(mode)
    shared = [rng.randrange(3, 100) for _ in range(10)]
    for i in range(6):
        prompt = shared + [rng.randrange(3, 100) for _ in range(rng.randrange(1, 30))]
        reqs = request(str(i), prompt, rng.randrange(5, 30), n=2 if i % 3 == 0 else 1)
        s.add_request(reqs[0], reqs[1:])
    run_and_check(s, rng)
    assert s.num_preemptions > 0  # the pool of 39 blocks is too small for all at once
    assert s.kv.num_free_blocks == s.kv.num_usable_blocks


def run_counting_rewrites(s: Scheduler, next_token: Callable[[], int]) -> tuple[int, int]:
    """Run s to completion, checking the runner's tables after each step; (the diffs that cut
    into a table the runner held, the null blocks seen in the runner's tables)."""
    states, cut, nulls = RequestStates(), 0, 0
    while s.has_unfinished_requests():
        out = s.schedule()
        held = {rid: len(st.block_ids) for rid, st in states.requests.items()}
        states.update(out)
        cut += sum(d.block_start < held[d.req_id] for d in out.cached_requests)
        for step in out.scheduled:
            table = states.requests[step.req_id].block_ids
            assert table == s.kv.get_block_ids(step.req_id)
            nulls += table.count(0)
        s.update_from_output(out, ModelRunnerOutput(
            [r.req_id for r in out.scheduled],
            [[next_token()] if r.sample else [] for r in out.scheduled]))
    return cut, nulls


def test_copy_on_write_replaces_a_block_in_the_runners_table():
    s = scheduler(num_blocks=40)
    leader, follower = request("a", list(range(3, 13)), 4, n=2)  # 10 tokens: a shared part
    s.add_request(leader, [follower])
    replaced, _ = run_counting_rewrites(s, lambda: 7)
    assert replaced >= 1  # a diff cut into the table the runner held: a block was replaced


def test_a_sliding_windows_null_blocks_reach_the_runners_table():
    """Blocks that leave the window become the null block in place: a rewrite of the table,
    not an append, which the diff must carry (with parallel samples' copy on write too)."""
    rng = random.Random(1)
    s = scheduler(num_blocks=60, sliding_window=8)
    for i in range(4):
        prompt = [rng.randrange(3, 100) for _ in range(rng.randrange(10, 40))]
        reqs = request(str(i), prompt, rng.randrange(10, 30), n=2 if i % 2 else 1)
        s.add_request(reqs[0], reqs[1:])
    cut, nulls = run_counting_rewrites(s, lambda: rng.randrange(3, 100))
    assert cut >= 4 and nulls > 0  # tables really were rewritten, blocks really dropped
    assert s.kv.num_free_blocks == s.kv.num_usable_blocks


def test_a_decode_step_sends_the_new_token_only():
    for prompt_len in (8, 400):
        s = scheduler(num_blocks=2000, budget=4096)
        for i in range(8):
            s.add_request(request(str(i), [5] * prompt_len, 8)[0])
        first = s.schedule()
        s.update_from_output(first, ModelRunnerOutput([r.req_id for r in first.scheduled],
                                                      [[7]] * len(first.scheduled)))
        out = s.schedule()
        assert not out.new_requests
        assert all(isinstance(d, CachedRequestData) and d.new_token_ids == [7]
                   and d.token_start == prompt_len for d in out.cached_requests)
        size = len(pickle.dumps(out))
        assert size < 3000, size  # same for both prompt lengths: no token lists, no tables
        assert len(pickle.dumps(first)) > prompt_len * 8  # the prompts went once


def test_applying_a_step_twice_changes_nothing():
    s = scheduler()
    s.add_request(request("a", list(range(3, 20)), 6)[0])
    states = RequestStates()
    out: SchedulerOutput | None = None
    for _ in range(4):
        out = s.schedule()
        states.update(out)
        s.update_from_output(out, ModelRunnerOutput(["a"], [[9]]))
    before = (list(states.requests["a"].output_token_ids), list(states.requests["a"].block_ids))
    states.update(out.for_request(0))
    assert (states.requests["a"].output_token_ids, states.requests["a"].block_ids) == before
