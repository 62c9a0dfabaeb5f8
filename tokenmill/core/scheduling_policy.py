"""The order requests are served in, a policy object of the scheduler (vLLM's
`--scheduling-policy`):

- `fcfs`: first come, first served. The waiting queue is a deque: arrivals at its tail,
  preempted requests (and forked samples) back at its head; when KV runs out the most recently
  admitted running request is preempted (the end of the running list).
- `priority`: a request's `priority` (an integer; lower is served first, vLLM's rule), then its
  arrival. The waiting queue is kept in (priority, arrival) order, a returning request placed
  before the others of its key; the running list is kept in the same order, so when KV runs
  out the running request with the largest (priority, arrival) is preempted. And, beyond
  vLLM: when the batch is full (max_num_seqs) and the head of the queue has a strictly lower
  priority value than a running request, that request (the largest key) is preempted to make
  room, so an urgent request does not wait for a running one to finish. The engine never
  changes a request's priority and has no aging rule: a steady stream of higher-priority work
  starves the rest, as in vLLM.
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Iterable

from tokenmill.core.request import Request

SCHEDULING_POLICIES = ("fcfs", "priority")


def _key(r: Request) -> tuple[int, float]:
    return r.priority, r.arrival_time


class PriorityQueue(deque):
    """A waiting queue in (priority, arrival) order with deque's interface: `append` files an
    arrival after the requests of its key, `appendleft` / `extendleft` a returning one
    before them."""

    def _insert(self, r: Request, before_equals: bool) -> None:
        find = bisect.bisect_left if before_equals else bisect.bisect_right
        self.insert(find(self, _key(r), key=_key), r)

    def append(self, r: Request) -> None:
        self._insert(r, before_equals=False)

    def appendleft(self, r: Request) -> None:
        self._insert(r, before_equals=True)

    def extendleft(self, rs: Iterable[Request]) -> None:
        for r in rs:
            self.appendleft(r)


class SchedulingPolicy:
    def __init__(self, name: str = "fcfs") -> None:
        if name not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy must be one of {', '.join(SCHEDULING_POLICIES)}"
                             f", got {name!r}")
        self.name = name

    @property
    def by_priority(self) -> bool:
        return self.name == "priority"

    def new_queue(self) -> deque[Request]:
        return PriorityQueue() if self.by_priority else deque()

    def order_running(self, running: list[Request]) -> None:
        """At the start of a step: the running list in the order it is served and preempted
        from the end (fcfs: admission order; priority: (priority, arrival), stable), so the
        victim `running.pop()` is never a request this step already scheduled."""
        if self.by_priority:
            running.sort(key=_key)

    def displaced(self, waiting: deque[Request], running: list[Request],
                  max_num_seqs: int) -> list[Request]:
        """Running requests to preempt now so that waiting ones of a strictly higher priority
        find a place in a full batch (priority only; removed from `running`, which is in
        `order_running`'s order: its lowest priority last)."""
        out: list[Request] = []
        if not self.by_priority:
            return out
        free = max_num_seqs - len(running)
        for head in list(waiting)[:max_num_seqs]:
            if free > 0:  # a place is free for it
                free -= 1
                continue
            if not running or running[-1].priority <= head.priority:
                break
            out.append(running.pop())  # its place goes to `head`
        return out
