"""The data-parallel routers (engine/dp_router.py): round robin takes the replicas in turn; the
cache-aware router sends a prompt where its prefix went before, unless that replica is
overloaded, balances prompts with nothing cached by load, and never remembers more blocks
than a replica's KV cache holds."""

from __future__ import annotations

import pytest

from tokenmill.engine.dp_router import CacheAwareRouter, RoundRobinRouter, make_router

BS = 4


def prompt(prefix: int, length: int = 24, tail: int = 0) -> list[int]:
    """A prompt whose first 16 tokens are shared by every prompt of the same `prefix`."""
    return [prefix * 1000 + i for i in range(16)] + [tail * 100 + i for i in range(length - 16)]


def test_round_robin_takes_the_replicas_in_turn():
    router = RoundRobinRouter(3)
    assert [router.route(prompt(0), [0, 0, 0]) for _ in range(7)] == [0, 1, 2, 0, 1, 2, 0]


def test_a_shared_prefix_goes_where_it_went_before():
    router = CacheAwareRouter(BS, [100, 100])
    first = [router.route(prompt(p), [0, 0]) for p in range(4)]  # nothing cached: spread
    assert sorted(first) == [0, 0, 1, 1]
    for p in range(4):
        for tail in range(1, 4):  # the same 16-token prefix, another tail: 16 of 24 match
            assert router.route(prompt(p, tail=tail), [3, 3]) == first[p]
    assert router.num_cache_routed == 12


def test_an_overloaded_replica_is_passed_over():
    router = CacheAwareRouter(BS, [100, 100], balance_abs=4, balance_rel=1.5)
    home = router.route(prompt(7), [0, 0])
    other = 1 - home
    loads = [0, 0]
    loads[home], loads[other] = 5, 2  # 3 more: within balance_abs, the cache wins
    assert router.route(prompt(7, tail=1), loads) == home
    loads[home] = 10  # 8 more than the other, and 5x: overloaded
    assert router.route(prompt(7, tail=2), loads) == other


def test_a_short_match_is_routed_by_load():
    router = CacheAwareRouter(BS, [100, 100])
    home = router.route(prompt(1, length=64), [0, 0])
    loads = [0, 0]
    loads[home] = 1
    # 16 of 64 tokens match (below the 0.5 threshold): the less loaded replica
    assert router.route(prompt(1, length=64, tail=9), loads) == 1 - home


def test_the_trees_never_exceed_the_replicas_caches():
    router = CacheAwareRouter(BS, [10, 10])
    for p in range(50):
        router.route(prompt(p, tail=p), [0, 0])
        for tree, cap in zip(router.trees, router.capacity, strict=True):
            assert tree.num_cached_blocks <= cap
            tree.check_integrity()
    assert router.matched_tokens(0, prompt(0, tail=0)) + \
        router.matched_tokens(1, prompt(0, tail=0)) == 0  # the oldest were evicted


def test_unknown_router_is_refused():
    with pytest.raises(ValueError, match="cache_aware, round_robin"):
        make_router("random", BS, [10, 10])
