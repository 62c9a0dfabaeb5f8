"""Admission of a waiting request, a policy object of the scheduler (core/scheduler.py): its
blocks and how many tokens it computes in its first step, under the step's token budget.

A request comes back from swap space with its KV copied in; a new or preempted one starts
past its longest cached prefix (the radix cache, when prefix caching is on, and the KV tiers
below it; a request whose next blocks are being read from files is passed over until they
are in memory: `waits_for_kv`); without chunked
prefill a prompt that does not fit the budget waits for a step that has room.

Invariant: a request that cannot start keeps no block (`allocate_slots` gives all or none).
"""

from __future__ import annotations

from tokenmill.core.kv_cache_manager import KVCacheManager
from tokenmill.core.request import Request, RequestStatus


class Admission:
    def __init__(self, kv: KVCacheManager, chunked_prefill: bool) -> None:
        self.kv = kv
        self.chunked_prefill = chunked_prefill
        self.swap_in: list[tuple[int, int]] = []  # (cpu, gpu) block copies for this step
        # the last refused request waits for its KV blocks being read from files: the next
        # waiting request may start meanwhile
        self.waits_for_kv = False

    def admit(self, request: Request, budget: int) -> int | None:
        """Give the request its blocks (a cache hit, swap-in or new ones); the number of
        tokens it computes this step, or None if it cannot start now."""
        self.waits_for_kv = False
        if request.status == RequestStatus.SWAPPED:
            n = min(request.num_tokens - request.num_computed_tokens, budget)
            copies = self.kv.swap_in(request, n)
            if copies is None:
                return None
            self.swap_in += copies
            return n
        computed = (self.kv.get_computed_blocks(request) if request.num_computed_tokens == 0
                    else None)
        if computed is not None and computed.wait_for_kv:
            self.waits_for_kv = True
            return None
        start = max(request.num_computed_tokens, computed.num_tokens if computed else 0)
        n = request.num_tokens - start
        if n > budget and not self.chunked_prefill:
            return None
        n = min(n, budget)
        if self.kv.allocate_slots(request, n, computed) is None:
            return None
        request.num_computed_tokens = start
        if request.num_cached_tokens is None:  # (a preempted request keeps its first count)
            request.num_cached_tokens = start
        return n

    def take_swap_in(self) -> list[tuple[int, int]]:
        copies, self.swap_in = self.swap_in, []
        return copies
