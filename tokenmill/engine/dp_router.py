"""Routers for data parallelism: which engine replica takes a request (engine/data_parallel.py).

    round_robin    the replicas in turn
    cache_aware    SGLang's cache-aware policy (the default): the replica most likely to hold
                   the longest prefix of the prompt in its prefix cache, unless it is
                   overloaded

The cache-aware router cannot read the replicas' caches (they change on their own threads,
step by step), so it keeps its own estimate, as SGLang's router does: per replica, a radix
tree (core/radix_cache.py, the same tree the KV cache manager uses) of the prompts it sent
there, in the replicas' whole blocks, holding at most as many blocks as the replica's KV cache
(least recently used evicted first, as the replica evicts). A request goes to the replica
whose tree matches the most of its prompt when that match is at least `cache_threshold` of the
prompt and that replica is not overloaded: its load (requests in flight) above the least
loaded replica's by more than `balance_abs` requests and `balance_rel` times. Otherwise it goes
to the least loaded replica, ties to the one whose tree holds the fewest blocks (the most room).

Invariant: a tree never holds more blocks than its replica's KV cache.
"""

from __future__ import annotations

import itertools
from abc import ABC, abstractmethod

from tokenmill.core.radix_cache import RadixCache

ROUTERS = ("cache_aware", "round_robin")


class Router(ABC):
    @abstractmethod
    def route(self, token_ids: list[int], loads: list[int]) -> int:
        """The replica for a prompt; loads: each replica's requests in flight."""


class RoundRobinRouter(Router):
    def __init__(self, num_replicas: int) -> None:
        self._next = itertools.cycle(range(num_replicas))

    def route(self, token_ids: list[int], loads: list[int]) -> int:
        return next(self._next)


class CacheAwareRouter(Router):
    def __init__(self, block_size: int, capacity_blocks: list[int], cache_threshold: float = 0.5,
                 balance_abs: int = 32, balance_rel: float = 1.5) -> None:
        self.block_size = block_size
        self.capacity = capacity_blocks
        self.trees = [RadixCache(block_size) for _ in capacity_blocks]
        self.cache_threshold, self.balance_abs, self.balance_rel = (cache_threshold,
                                                                    balance_abs, balance_rel)
        self._block_ids = itertools.count()  # the trees' values: placeholders for blocks
        self.num_cache_routed = 0  # requests sent where their prefix is (for tests and logs)

    def matched_tokens(self, replica: int, token_ids: list[int]) -> int:
        return self.trees[replica].match_prefix(token_ids).num_tokens(self.block_size)

    def route(self, token_ids: list[int], loads: list[int]) -> int:
        matches = [self.matched_tokens(i, token_ids) for i in range(len(self.trees))]
        best = max(range(len(matches)), key=lambda i: (matches[i], -loads[i]))
        least = min(loads)
        overloaded = (loads[best] - least > self.balance_abs
                      and loads[best] > self.balance_rel * least)
        if matches[best] >= self.cache_threshold * len(token_ids) and not overloaded:
            self.num_cache_routed += 1
            choice = best
        else:
            choice = min(range(len(loads)),
                         key=lambda i: (loads[i], self.trees[i].num_cached_blocks))
        self._remember(choice, token_ids)
        return choice

    def _remember(self, replica: int, token_ids: list[int]) -> None:
        """The prompt's whole blocks are (about to be) in the replica's prefix cache."""
        tree = self.trees[replica]
        n = len(token_ids) // self.block_size
        if n == 0:
            return
        ids = token_ids[:n * self.block_size]
        tree.insert_prefix(ids, [next(self._block_ids) for _ in range(n)])
        over = tree.num_cached_blocks - self.capacity[replica]
        if over > 0:
            tree.evict(over)


def make_router(name: str, block_size: int, capacity_blocks: list[int]) -> Router:
    if name == "round_robin":
        return RoundRobinRouter(len(capacity_blocks))
    if name == "cache_aware":
        return CacheAwareRouter(block_size, capacity_blocks)
    raise ValueError(f"data_parallel_router must be one of {', '.join(ROUTERS)}, got {name!r}")
