"""HostIndex: LRU reuse of host slots, pins that keep a slot from another key, pending reads
invisible to lookups until confirmed."""

from __future__ import annotations

import pytest

from tokenmill.kv_offload.host_index import HostIndex


def k(i: int) -> bytes:
    return bytes([i]) * 16


def test_lru_reuse_skips_pinned_slots():
    index = HostIndex(2, first_slot=10)
    a, b = index.allocate(k(1)), index.allocate(k(2))
    assert {a, b} == {10, 11}
    index.lookup(k(1))  # k(1) recently used: k(2) goes first
    assert index.allocate(k(3)) == b and index.lookup(k(2)) is None
    index.pin(a)
    index.pin(b)
    assert index.allocate(k(4)) is None  # every slot pinned
    index.pin(b, unpin=True)
    assert index.allocate(k(4)) == b and index.lookup(k(1)) == a
    index.check_integrity()
    with pytest.raises(RuntimeError):
        index.pin(b, unpin=True)


def test_pending_reads_are_found_only_once_confirmed():
    index = HostIndex(3)
    slot = index.allocate(k(1), pending=True)
    assert index.lookup(k(1)) is None and index.is_pending(k(1)) and k(1) in index
    assert index.num_available() == 2
    index.confirm(k(1), ok=True)
    assert index.lookup(k(1)) == slot and index.num_available() == 3
    bad = index.allocate(k(2), pending=True)
    index.confirm(k(2), ok=False)
    assert index.lookup(k(2)) is None and k(2) not in index
    assert index.allocate(k(3)) == bad  # the failed read's slot is free again
    index.clear()
    assert len(index) == 0
    index.check_integrity()
