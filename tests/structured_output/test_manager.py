"""StructuredOutputManager: one compile per distinct constraint; a step's bitmasks have one row
per sampled position, row j being the mask after the request's first j drafts, with the
matcher back where it was afterwards; a draft the grammar refuses leaves the rows after it
unconstrained (unused: the draft is rejected at its own row)."""

from __future__ import annotations

import pytest
import torch

from tokenmill.core.interface import RequestStep, SchedulerOutput
from tokenmill.structured_output import StructuredOutputsConfig, StructuredOutputsParams
from tokenmill.structured_output.backend import bitmask_width
from tokenmill.structured_output.manager import StructuredOutputManager

V = 49152


@pytest.fixture(scope="module")
def manager(smollm2_path):
    from tokenmill.config_model import model_config
    from tokenmill.engine.tokenizer import load_tokenizer

    tok = load_tokenizer(model_config(smollm2_path))
    return StructuredOutputManager(StructuredOutputsConfig(), tok, V, [2]), tok


def row(req_id: str, drafts: list[int], sample: bool = True) -> RequestStep:
    return RequestStep(req_id=req_id, start_pos=3, num_new_tokens=1, sample=sample,
                       spec_token_ids=drafts)


def mask_of(matcher) -> torch.Tensor:
    m = torch.zeros(1, bitmask_width(V), dtype=torch.int32)
    matcher.fill_bitmask(m, 0)
    return m[0]


def test_compiles_each_constraint_once(manager):
    mgr, _ = manager
    a = mgr.compile(StructuredOutputsParams(regex="ab+"))
    assert mgr.compile(StructuredOutputsParams(regex="ab+")) is a
    assert mgr.compile(StructuredOutputsParams(regex="ab*")) is not a


def test_rows_follow_the_drafts_and_the_matcher_is_restored(manager):
    mgr, tok = manager
    grammar = mgr.compile(StructuredOutputsParams(choice=["hello world", "goodbye"]))
    hello = tok.encode("hello world", add_special_tokens=False)
    assert len(hello) >= 2
    m, other = grammar.matcher(), grammar.matcher()
    before = mask_of(m)
    sched = SchedulerOutput(scheduled=[row("a", hello), row("b", [], sample=False),
                                       row("c", [])])
    masks = mgr.submit(sched, {"a": m, "b": other, "c": other}).masks()
    assert set(masks) == {"a", "c"}  # b does not sample this step
    assert masks["a"].shape == (1 + len(hello), bitmask_width(V))
    ref = grammar.matcher()
    assert torch.equal(masks["a"][0], mask_of(ref))
    for j, t in enumerate(hello):
        ref.accept(t)
        if not ref.is_terminated():
            assert torch.equal(masks["a"][j + 1], mask_of(ref))
    assert torch.equal(mask_of(m), before)  # rolled back


def test_rows_after_a_refused_draft_are_unconstrained(manager):
    mgr, tok = manager
    m = mgr.compile(StructuredOutputsParams(choice=["yes", "no"])).matcher()
    bad = tok.encode("maybe so", add_special_tokens=False)
    masks = mgr.submit(SchedulerOutput(scheduled=[row("a", bad)]), {"a": m}).masks()
    assert torch.equal(masks["a"][0], mask_of(m))
    assert bool((masks["a"][1:] == -1).all())
    assert m.error() is None  # the refused draft never reached the matcher
    assert mgr.submit(SchedulerOutput(scheduled=[row("z", [])]), {}) is None
