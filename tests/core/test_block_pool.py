"""BlockPool and KVCacheManager: exact block ids, reference counts, free order, copy-on-write."""

from __future__ import annotations

import pytest

from tokenmill.core.block_pool import BlockPool
from tokenmill.core.kv_cache_manager import KVCacheManager
from tokenmill.core.request import Request
from tokenmill.sampling_params import SamplingParams


def make_request(rid: str, n_prompt: int) -> Request:
    return Request(rid, list(range(3, 3 + n_prompt)), SamplingParams(max_tokens=8), [2], 8)


def test_pool_allocates_in_order_and_pins_null_block():
    pool = BlockPool(11)
    assert pool.num_free_blocks == 10
    blocks = pool.get_new_blocks(3)
    assert [b.block_id for b in blocks] == [1, 2, 3]
    assert all(b.ref_cnt == 1 for b in blocks)
    assert pool.num_free_blocks == 7
    pool.check_integrity()


def test_pool_hands_out_recently_freed_blocks_first():
    pool = BlockPool(9)
    a = pool.get_new_blocks(5)  # 1..5
    assert [b.block_id for b in a] == [1, 2, 3, 4, 5]
    pool.free_blocks([a[4], a[2]])  # 5, then 3
    # the last freed first, then the fresh ones in id order
    assert [b.block_id for b in pool.get_new_blocks(4)] == [3, 5, 6, 7]
    pool.check_integrity()


def test_a_fresh_block_referenced_out_of_turn_is_skipped():
    pool = BlockPool(8)
    pool.incr_ref([pool.blocks[2], pool.blocks[5]])  # fresh blocks taken by reference
    assert pool.num_free_blocks == 5
    assert [b.block_id for b in pool.get_new_blocks(5)] == [1, 3, 4, 6, 7]
    assert pool.num_free_blocks == 0
    pool.check_integrity()
    pool.free_blocks([pool.blocks[5]])
    assert [b.block_id for b in pool.get_new_blocks(1)] == [5]


def test_a_gpu_sized_pool_hands_out_every_fresh_block_in_id_order():
    """400,000 blocks (an H200's KV cache of a small model), in batches of 100; the cost per
    block is benchmarks/host_step.py's to show (the walk over the taken ids of the dict the
    pool had is quadratic: 2.8 s for 100,000 blocks on a Zen 4 core)."""
    pool = BlockPool(400_001)
    ids = [b.block_id for _ in range(4000) for b in pool.get_new_blocks(100)]
    assert ids == list(range(1, 400_001))
    pool.check_integrity()


def test_pool_ref_counts_and_double_free():
    pool = BlockPool(4)
    (b,) = pool.get_new_blocks(1)
    pool.incr_ref([b])
    assert b.ref_cnt == 2
    pool.free_blocks([b])
    assert b.ref_cnt == 1 and pool.num_free_blocks == 2
    pool.free_blocks([b])
    assert b.ref_cnt == 0 and pool.num_free_blocks == 3
    with pytest.raises(RuntimeError, match="double free"):
        pool.free_blocks([b])
    with pytest.raises(RuntimeError):
        pool.get_new_blocks(4)


def test_integrity_check_catches_corruption():
    pool = BlockPool(4)
    (b,) = pool.get_new_blocks(1)
    b.ref_cnt = 0  # leaked: neither free nor in use
    with pytest.raises(AssertionError):
        pool.check_integrity()


def test_allocate_slots_exact_blocks_and_none_when_full():
    kv = KVCacheManager(num_blocks=11, block_size=16)
    a, b = make_request("a", 40), make_request("b", 100)
    assert kv.allocate_slots(a, 40) == [1, 2, 3]  # 40 tokens → 3 blocks
    a.num_computed_tokens = 40
    assert kv.allocate_slots(a, 8) == []  # fits in block 3 (slots 32..47)
    a.num_computed_tokens = 48
    assert kv.allocate_slots(a, 1) == [4]
    # b needs 7 blocks, 6 are free: refused, nothing changes
    assert kv.allocate_slots(b, 100) is None
    assert kv.num_free_blocks == 6 and kv.get_block_ids("b") == []
    kv.check_integrity()
    kv.free(a)
    assert kv.num_free_blocks == 10
    # freed tail first, handed out most recently freed first: a's blocks come back in their
    # order, before any never-used block
    assert kv.allocate_slots(b, 100) == [1, 2, 3, 4, 5, 6, 7]
    kv.check_integrity()


def test_fork_shares_blocks_and_copies_on_write():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    parent, child = make_request("p", 6), make_request("c", 6)
    assert kv.allocate_slots(parent, 6) == [1, 2]
    parent.num_computed_tokens = child.num_computed_tokens = 6
    kv.fork(parent, child)
    assert [b.ref_cnt for b in kv.req_to_blocks["p"]] == [2, 2]
    kv.check_integrity()
    # The child writes token 6 into shared, half-full block 2: it gets a private copy.
    assert kv.allocate_slots(child, 1) == [3]
    assert kv.get_block_ids("c") == [1, 3] and kv.get_block_ids("p") == [1, 2]
    assert kv.take_pending_copies() == [(2, 3)]
    assert kv.take_pending_copies() == []
    # Block 2 is now the parent's alone: no copy when the parent writes into it.
    assert kv.allocate_slots(parent, 1) == []
    assert kv.take_pending_copies() == []
    kv.check_integrity()
    kv.free(parent)
    kv.free(child)
    assert kv.num_free_blocks == 7
    kv.check_integrity()


def test_fork_at_block_boundary_needs_no_copy():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    parent, child = make_request("p", 8), make_request("c", 8)
    kv.allocate_slots(parent, 8)
    parent.num_computed_tokens = child.num_computed_tokens = 8
    kv.fork(parent, child)
    assert kv.allocate_slots(child, 1) == [3]
    assert kv.take_pending_copies() == []
    assert kv.get_block_ids("c") == [1, 2, 3]
