"""SpecCosts measured at start-up: a verify step's cost per draft and a draft model's forward,
in decode steps, reach the scheduler's policy; a dearer verify step means fewer drafts."""

from __future__ import annotations

from tokenmill import LLM
from tokenmill.spec_decode.policy import SpecCosts, draft_length


def test_engine_measures_costs_and_the_scheduler_uses_them(tiny_model):
    path, _ = tiny_model("llama")
    assert LLM(path, max_model_len=256).engine.runner.spec_costs is None  # nothing to weigh
    llm = LLM(path, max_model_len=256, speculative_config={"method": "draft_model",
                                                           "quantization": "int8"})
    costs = llm.engine.runner.spec_costs
    assert 0 <= costs.verify_per_draft < 5 and 0 < costs.draft_forward < 5
    assert llm.engine.scheduler.spec.costs is costs
    assert len(costs.verify_curve) == 4 and costs.verify_curve[0] == 1.0  # k = 0..3
    assert all(c >= 1.0 for c in costs.verify_curve)
    # num_speculative_tokens 8: steps of up to 9 tokens measured and allowed
    eight = LLM(path, max_model_len=256, speculative_config={"method": "ngram",
                                                             "num_speculative_tokens": 8})
    assert len(eight.engine.runner.spec_costs.verify_curve) == 9
    assert eight.engine.scheduler.spec.step_tokens == 9
    ngram = LLM(path, max_model_len=256, speculative_config={"method": "ngram"})
    assert ngram.engine.runner.spec_costs.draft_forward == 0.0


def test_dearer_steps_mean_fewer_drafts():
    assert draft_length(0.6, 3, False, verify_cost=0.05) == 3
    assert draft_length(0.6, 3, False, verify_cost=0.3) == 1
    assert draft_length(0.6, 3, False, verify_cost=1.0) == 0
    # a draft model's forward adds to each draft's cost
    assert draft_length(0.9, 3, False, verify_cost=0.2, draft_cost=0.4) == 2
    assert draft_length(1.0, 3, False, verify_cost=0.2, draft_cost=0.4) == 3
    assert draft_length(0.9, 3, False, verify_cost=0.2, draft_cost=1.0) == 0
    assert SpecCosts(0.2).draft_forward == 0.0
    # a measured curve decides where it reaches: steps past the fused call's 4 tokens dearer
    curve = (1.0, 1.2, 1.4, 1.6, 3.0, 3.4, 3.8)
    assert draft_length(0.9, 6, False, verify_cost=0.2, verify_curve=curve) == 3
    assert draft_length(0.9, 6, False, verify_cost=0.2, verify_curve=curve[:4]) == 6
