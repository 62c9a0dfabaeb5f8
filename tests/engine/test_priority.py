"""Priority scheduling on a real tiny model: 48 long low-priority requests at max_num_seqs 16,
then one urgent request: it finishes in well under half their mean latency (in engine steps),
and every request's greedy tokens are those it gets under fcfs (preemption loses nothing).
A priority without the priority policy, or not an integer, is refused."""

from __future__ import annotations

import random
import statistics

import pytest

from tokenmill import LLM, SamplingParams

PARAMS = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def _run(llm: LLM, prompts: list[list[int]], urgent: list[int], priority: bool
         ) -> tuple[dict[str, list[int]], dict[str, int]]:
    """Outputs and latencies in steps: the 48 from step 0, the urgent one from step 4."""
    engine = llm.engine
    for i, p in enumerate(prompts):
        engine.add_request(f"low{i}", p, PARAMS, priority=10 if priority else 0)
    arrival = {f"low{i}": 0 for i in range(len(prompts))}
    outs: dict[str, list[int]] = {}
    latency: dict[str, int] = {}
    step = 0
    while engine.has_unfinished_requests():
        if step == 4:
            engine.add_request("urgent", urgent, PARAMS, priority=0)
            arrival["urgent"] = step
        for out in engine.step():
            if out.finished:
                outs[out.request_id] = out.outputs[0].token_ids
                latency[out.request_id] = step - arrival[out.request_id]
        step += 1
    return outs, latency


def test_an_urgent_request_overtakes_a_long_queue(tiny_model):
    path, _ = tiny_model("llama")
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 4000) for _ in range(24)] for _ in range(48)]
    urgent = [rng.randrange(3, 4000) for _ in range(24)]
    by_priority = LLM(path, scheduling_policy="priority", max_num_seqs=16)
    outs, latency = _run(by_priority, prompts, urgent, priority=True)
    lows = [v for k, v in latency.items() if k != "urgent"]
    assert latency["urgent"] < 0.5 * statistics.mean(lows)
    assert by_priority.engine.scheduler.num_preemptions >= 1
    fcfs_outs, fcfs_latency = _run(LLM(path, max_num_seqs=16), prompts, urgent, priority=False)
    assert outs == fcfs_outs  # the same tokens, whoever waited
    assert fcfs_latency["urgent"] > latency["urgent"]


def test_priority_is_refused_where_it_means_nothing(tiny_model):
    path, _ = tiny_model("llama")
    llm = LLM(path)
    with pytest.raises(ValueError, match="priority scheduling policy"):
        llm.generate([[5, 6, 7]], PARAMS, use_tqdm=False, priority=[1])
    with pytest.raises(ValueError, match="one per prompt"):
        llm.generate([[5, 6, 7]], PARAMS, use_tqdm=False, priority=[0, 0])
    by_priority = LLM(path, scheduling_policy="priority")
    with pytest.raises(ValueError, match="integer"):
        by_priority.generate([[5, 6, 7]], PARAMS, use_tqdm=False, priority=[1.5])
    assert len(by_priority.generate([[5, 6, 7]], PARAMS, use_tqdm=False, priority=[-3])) == 1
