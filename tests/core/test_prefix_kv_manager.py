"""KVCacheManager with prefix caching and swap: exact block ids, reference counts, eviction
under pressure, swap out/in bookkeeping; integrity checked after every operation."""

from __future__ import annotations

import pytest

from tokenmill.core.kv_cache_manager import KVCacheManager
from tokenmill.core.request import Request
from tokenmill.sampling_params import SamplingParams

BS = 4


def req(rid: str, tokens: list[int]) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=4), [2], 4)


def admit(kv: KVCacheManager, r: Request) -> list[int]:
    """What the scheduler does: look up the cache, allocate the rest, compute it all."""
    hit = kv.get_computed_blocks(r)
    new = kv.allocate_slots(r, r.num_tokens - hit.num_tokens, hit)
    assert new is not None
    r.num_computed_tokens = r.num_tokens
    kv.check_integrity()
    return new


def test_second_request_reuses_the_prefix():
    kv = KVCacheManager(11, BS, enable_prefix_caching=True)
    a = req("a", list(range(100, 110)))  # 10 tokens: blocks 1, 2 full, 3 partial
    assert admit(kv, a) == [1, 2, 3]
    assert [kv.pool.blocks[i].ref_cnt for i in (1, 2, 3)] == [2, 2, 1]  # tree + request
    b = req("b", list(range(100, 108)) + [7, 7, 7])  # shares blocks 1, 2
    hit = kv.get_computed_blocks(b)
    assert [x.block_id for x in hit.blocks] == [1, 2] and hit.num_tokens == 8
    assert kv.allocate_slots(b, 3, hit) == [4]
    assert [kv.pool.blocks[i].ref_cnt for i in (1, 2)] == [3, 3]
    assert (kv.prefix_queries, kv.prefix_hits) == (21, 8)
    kv.check_integrity()
    kv.free(a)
    kv.free(b)
    # the full blocks stay cached but count as free
    assert kv.tree.num_cached_blocks == 2 and kv.num_free_blocks == 10
    kv.check_integrity()


def test_fully_cached_prompt_still_computes_its_last_token():
    kv = KVCacheManager(11, BS, enable_prefix_caching=True)
    admit(kv, req("a", list(range(8))))
    kv.free(req("a", list(range(8))))
    again = req("b", list(range(8)))
    hit = kv.get_computed_blocks(again)
    assert hit.num_tokens == 4  # 7 tokens looked up: one whole block; 4 tokens left to do


def test_eviction_frees_lru_cached_blocks_when_needed():
    kv = KVCacheManager(5, BS, enable_prefix_caching=True)  # 4 usable blocks
    a, b = req("a", list(range(8))), req("b", list(range(50, 58)))
    admit(kv, a)
    kv.free(a)
    admit(kv, b)
    kv.free(b)
    assert kv.tree.num_cached_blocks == 4 and kv.pool.num_free_blocks == 0
    c = req("c", list(range(90, 98)))
    assert admit(kv, c) == [1, 2]  # a's node was least recently used: evicted, reused
    assert kv.get_computed_blocks(req("d", list(range(50, 58)) + [1])).num_tokens == 8
    assert kv.get_computed_blocks(req("e", list(range(8)) + [1])).num_tokens == 0


def test_locked_prefix_is_never_evicted():
    kv = KVCacheManager(4, BS, enable_prefix_caching=True)  # 3 usable
    a = req("a", list(range(8)))
    admit(kv, a)  # a still running: its 2 blocks are locked
    big = req("big", list(range(60, 72)))  # needs 3 blocks, only 1 is free
    assert kv.allocate_slots(big, 12, kv.get_computed_blocks(big)) is None
    assert kv.get_block_ids("a") == [1, 2] and kv.get_block_ids("big") == []
    kv.check_integrity()


def test_swap_out_and_in_keep_accounting():
    kv = KVCacheManager(8, BS, enable_prefix_caching=True, num_swap_blocks=3)
    a = req("a", list(range(10)))
    admit(kv, a)
    out = kv.swap_out(a)
    assert out == [(1, 0), (2, 1), (3, 2)] and kv.get_block_ids("a") == []
    assert kv.swap.num_free_blocks == 0
    kv.check_integrity()
    b = req("b", list(range(30, 34)))
    admit(kv, b)
    assert kv.swap_out(b) is None  # a fills the swap space: b must be recomputed instead
    assert kv.get_block_ids("b") != []  # and nothing changed for it
    kv.free(b)
    a.append_output_token(5)
    back = kv.swap_in(a, 1)
    assert [c for c, _ in back] == [0, 1, 2] and kv.swap.num_free_blocks == 3
    assert len(kv.get_block_ids("a")) == 3
    kv.check_integrity()
    kv.free(a)
    assert kv.num_free_blocks == kv.num_usable_blocks
    kv.check_integrity()


def test_reset_prefix_cache_only_when_idle():
    kv = KVCacheManager(11, BS, enable_prefix_caching=True)
    a = req("a", list(range(100, 110)))
    admit(kv, a)
    assert not kv.reset_prefix_cache()  # a holds blocks: nothing is dropped
    assert kv.tree.num_cached_blocks == 2
    kv.free(a)
    assert kv.reset_prefix_cache()
    assert kv.tree.num_cached_blocks == 0 and kv.pool.num_free_blocks == 10
    kv.check_integrity()
    again = req("b", list(range(100, 110)))
    assert kv.get_computed_blocks(again).num_tokens == 0  # computed from scratch
    assert KVCacheManager(3, BS).reset_prefix_cache()  # no prefix caching: nothing to drop


@pytest.mark.parametrize("sliding_window", [None, 12])
def test_decoding_offers_blocks_as_a_whole_prefix_insert_would(monkeypatch, sliding_window):
    """A decoding request's newly full blocks continue its locked node in the tree
    (PrefixOffers._extend) rather than matching the whole path from the root: the
    tree, the pool's references and the locks end exactly as with insert_prefix alone, also
    with another request sharing then leaving the path, and a window dropping blocks."""
    import random

    from tokenmill.core.prefix_offers import PrefixOffers

    extend, extended = PrefixOffers._extend, []

    def run(fast: bool) -> tuple:
        def offer(self, *args) -> bool:  # the fast path, or always the whole-prefix insert
            if not fast:
                return False
            extended.append(extend(self, *args))
            return extended[-1]

        monkeypatch.setattr(PrefixOffers, "_extend", offer)
        rng = random.Random(0)
        kv = KVCacheManager(64, BS, enable_prefix_caching=True, sliding_window=sliding_window)
        shared = [rng.randrange(100, 200) for _ in range(9)]
        a, b = req("a", shared + [5]), req("b", shared + [6, 6, 6])
        for r in (a, b):
            admit(kv, r)
        for step in range(23):
            for r in (a, b) if step < 11 else (a,):
                r.append_output_token(rng.randrange(100, 104))  # often the same tokens
                assert kv.allocate_slots(r, 1) is not None
                r.num_computed_tokens += 1
                kv.check_integrity()
            if step == 10:
                kv.free(b)
        tree = sorted((tuple(kv.tree.path_tokens(n)), tuple(n.value), n.lock_ref)
                      for n in kv.tree.nodes())
        return tree, [blk.ref_cnt for blk in kv.pool.blocks], kv.get_block_ids("a")

    assert run(fast=True) == run(fast=False)
    assert extended.count(True) >= (0 if sliding_window else 5)  # the fast path really ran
