"""RadixCache unit tests with exact expectations: insert, match, split, locks, LRU eviction
leaves first, and the integrity check after every operation."""

from __future__ import annotations

import pytest

from tokenmill.core.radix_cache import RadixCache

BS = 4


def toks(*blocks: int) -> list[int]:
    """Token ids made of whole blocks: block b is [b*10, b*10+1, b*10+2, b*10+3]."""
    return [b * 10 + i for b in blocks for i in range(BS)]


def test_insert_then_match_whole_and_partial():
    t = RadixCache(BS)
    r = t.insert_prefix(toks(1, 2, 3), [11, 12, 13])
    assert r.cached_len == 0 and t.num_cached_blocks == 3 and t.num_evictable_blocks == 3
    assert t.match_prefix(toks(1, 2, 3)).block_ids == [11, 12, 13]
    m = t.match_prefix(toks(1, 2) + [99, 98])  # a partial block never matches
    assert m.block_ids == [11, 12]
    assert t.match_prefix(toks(1, 2, 3)[:7]).block_ids == [11]
    assert t.match_prefix(toks(5)).block_ids == []
    t.check_integrity()


def test_branching_prefixes_share_and_split():
    t = RadixCache(BS)
    t.insert_prefix(toks(1, 2, 3), [11, 12, 13])
    r = t.insert_prefix(toks(1, 2, 7), [21, 22, 27])  # shares blocks 1, 2: splits the edge
    assert r.cached_len == 2 * BS
    assert t.num_cached_blocks == 4  # 11, 12 kept; 21, 22 not adopted; 27 new
    assert t.match_prefix(toks(1, 2, 7)).block_ids == [11, 12, 27]
    assert t.match_prefix(toks(1, 2, 3)).block_ids == [11, 12, 13]
    root_children = list(t.root.children.values())
    assert len(root_children) == 1 and root_children[0].value == [11, 12]
    assert sorted(c.value[0] for c in root_children[0].children.values()) == [13, 27]
    t.check_integrity()


def test_locks_protect_from_eviction_and_count():
    t = RadixCache(BS)
    t.insert_prefix(toks(1, 2), [11, 12])
    h = t.insert_prefix(toks(1, 2, 3), [11, 12, 13]).handle
    t.lock_handle(h)
    assert t.num_evictable_blocks == 0
    assert t.evict(10) == []
    t.lock_handle(h, unlock=True)
    assert t.num_evictable_blocks == 3
    with pytest.raises(RuntimeError):
        t.lock_handle(h, unlock=True)


def test_lock_survives_a_split():
    t = RadixCache(BS)
    h = t.insert_prefix(toks(1, 2, 3), [11, 12, 13]).handle
    t.lock_handle(h)
    upper = t.match_prefix(toks(1)).handle  # splits the locked edge after one block
    assert upper.value == [11] and upper.lock_ref == 1
    t.check_integrity()
    t.lock_handle(h, unlock=True)
    assert t.num_evictable_blocks == 3
    t.check_integrity()


def test_evict_lru_leaves_first():
    t = RadixCache(BS)
    t.insert_prefix(toks(1, 2), [11, 12])
    t.insert_prefix(toks(1, 2, 3), [11, 12, 13])  # leaf under [1, 2]
    t.insert_prefix(toks(5), [15])  # another root child
    t.match_prefix(toks(5))  # 5 is now the most recently used
    assert t.evict(1) == [13]  # the LRU leaf, not its parent
    assert t.evict(1) == [11, 12]  # its parent became a leaf and is next
    assert t.evict(5) == [15]
    assert t.num_cached_blocks == 0 and t.evict(1) == []
    t.check_integrity()


def test_integrity_check_catches_drift():
    t = RadixCache(BS)
    t.insert_prefix(toks(1), [11])
    t.num_evictable_blocks += 1
    with pytest.raises(AssertionError):
        t.check_integrity()


def test_insert_needs_whole_blocks():
    with pytest.raises(ValueError):
        RadixCache(BS).insert_prefix([1, 2, 3], [7])


def test_extend_continues_a_node_as_insert_prefix_would():
    t = RadixCache(BS)
    h = t.insert_prefix(toks(1, 2), [11, 12]).handle
    r = t.extend(h, toks(3), [13])
    assert r.cached_len == 2 * BS and r.handle.end == 3 * BS and r.handle.parent is h
    assert t.match_prefix(toks(1, 2, 3)).block_ids == [11, 12, 13]
    assert t.num_cached_blocks == 3 and t.num_evictable_blocks == 3
    # the path was touched as a match touches it: the whole path is newer than a later leaf's
    assert h.last_access == r.handle.last_access
    t.check_integrity()
    # a split above the handle keeps its end: extending it goes on from the same place
    t.match_prefix(toks(1))
    r2 = t.extend(r.handle, toks(4, 5), [14, 15])
    assert r2.handle.end == 5 * BS
    assert t.match_prefix(toks(1, 2, 3, 4, 5)).block_ids == [11, 12, 13, 14, 15]
    t.check_integrity()


def test_extend_declines_where_the_tree_already_continues():
    t = RadixCache(BS)
    h = t.insert_prefix(toks(1, 2), [11, 12]).handle
    t.insert_prefix(toks(1, 2, 3), [11, 12, 23])  # another request's block 3
    assert t.extend(h, toks(3, 4), [13, 14]) is None  # insert_prefix must share block 3
    assert t.extend(t.root, toks(9), [19]) is None
    assert t.num_cached_blocks == 3
    with pytest.raises(ValueError):
        t.extend(h, toks(5)[:3], [15])
    t.check_integrity()
