"""PrefixOffers on its own tree and pool: each block offered once, the tree's references taken
for what it adopts, one lock per request moved down its path as blocks fill, a forked child's
count capped at what it shares, and `forget` undoing the lock but not the cached blocks."""

from __future__ import annotations

from tokenmill.core.block_pool import BlockPool
from tokenmill.core.prefix_offers import PrefixOffers
from tokenmill.core.radix_cache import RadixCache
from tokenmill.core.request import Request
from tokenmill.sampling_params import SamplingParams

BS = 4


def setup() -> tuple[PrefixOffers, RadixCache, BlockPool]:
    tree, pool = RadixCache(BS), BlockPool(16)
    return PrefixOffers(tree, pool, BS, None, None), tree, pool


def request(rid: str, tokens: list[int]) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=4), [2], 4)


def test_blocks_are_offered_once_and_the_lock_follows_the_path():
    offers, tree, pool = setup()
    r = request("a", list(range(100, 110)))  # 2 full blocks and 2 tokens
    blocks = pool.get_new_blocks(3)
    offers.offer(r, blocks, 5)  # one full block
    assert tree.num_cached_blocks == 1 and offers.num_offered["a"] == 1
    assert [b.ref_cnt for b in blocks] == [2, 1, 1]  # the request's and the tree's
    first = offers.handles["a"]
    assert first.lock_ref == 1
    offers.offer(r, blocks, 7)  # nothing newly full: nothing offered
    assert tree.num_cached_blocks == 1
    offers.offer(r, blocks, 10)
    assert tree.num_cached_blocks == 2 and offers.num_offered["a"] == 2
    assert [b.ref_cnt for b in blocks] == [2, 2, 1]
    handle = offers.handles["a"]
    assert handle.end == 8 and handle.lock_ref == 1 and first.lock_ref == 1  # path locked once
    tree.check_integrity()
    offers.forget("a")
    assert "a" not in offers.handles and "a" not in offers.num_offered
    assert handle.lock_ref == 0 and tree.num_evictable_blocks == 2  # cached, now evictable
    assert [b.ref_cnt for b in blocks] == [2, 2, 1]  # the tree keeps its references


def test_a_forked_child_shares_the_lock_and_at_most_its_full_blocks():
    offers, tree, pool = setup()
    parent = request("p", list(range(100, 112)))
    offers.offer(parent, pool.get_new_blocks(3), 12)
    assert offers.num_offered["p"] == 3
    offers.inherit("p", "c", 2)
    assert offers.num_offered["c"] == 2 and offers.handles["c"] is offers.handles["p"]
    assert offers.handles["p"].lock_ref == 2
    offers.forget("p")
    assert offers.handles["c"].lock_ref == 1
    tree.check_integrity()


def test_locking_the_same_node_again_keeps_one_lock():
    offers, tree, pool = setup()
    r = request("a", list(range(100, 108)))
    offers.offer(r, pool.get_new_blocks(2), 8)
    node = offers.handles["a"]
    offers.lock("a", node)  # locked before the old one is unlocked: never at zero between
    assert node.lock_ref == 1 and offers.handles["a"] is node
    offers.lock("a", None)
    assert node.lock_ref == 0 and "a" not in offers.handles
