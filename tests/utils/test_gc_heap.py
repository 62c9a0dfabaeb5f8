"""The engine's start-up heap is frozen out of the cyclic garbage collector, and an engine
dropped afterwards is still freed (utils/gc_heap.py's invariant)."""

from __future__ import annotations

import gc
import weakref

import pytest

from tokenmill import LLM, SamplingParams
from tokenmill.utils import gc_heap


@pytest.fixture(autouse=True)
def freezing(monkeypatch):
    """As every engine outside the test suite does (tests/conftest.py turns it off)."""
    monkeypatch.setattr(gc_heap, "ENABLED", True)


def _tracked_ids() -> set[int]:
    """Objects the collector walks (the frozen ones are in none of its generations)."""
    return {id(o) for generation in range(3) for o in gc.get_objects(generation)}


def test_an_engine_freezes_its_start_up_heap_and_is_freed_when_dropped(tiny_model):
    path, _ = tiny_model("llama")
    llm = LLM(path, max_model_len=128, num_kv_blocks=16)
    llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3, n=2, stop=["x"]), use_tqdm=False)
    model = weakref.ref(llm.engine.runner.model)
    assert gc.get_freeze_count() > 0
    tracked = _tracked_ids()
    assert id(llm.engine.runner.model) not in tracked
    assert id(llm.engine.scheduler) not in tracked
    # a later engine's start freezes this one too: dropping it must still free it (by
    # reference counting, since no cycle holds it)
    gc.collect()
    gc.freeze()
    del llm
    gc.collect()
    assert model() is None


class _Cycle:
    def __init__(self) -> None:
        self.me = self


def test_garbage_frozen_by_one_engine_is_collected_when_the_next_starts(tiny_model):
    """A process that starts several engines (a notebook, this test suite) keeps none of the
    cycles that became garbage while frozen: each start unfreezes what the last one froze."""
    path, _ = tiny_model("llama")
    cycle = _Cycle()
    alive = weakref.ref(cycle)
    first = LLM(path, max_model_len=128, num_kv_blocks=16)  # freezes the cycle with the rest
    del cycle
    gc.collect()
    assert alive() is not None  # frozen: the collector does not see it
    del first
    LLM(path, max_model_len=128, num_kv_blocks=16)
    assert alive() is None
