"""SampleGroups: the further samples of an n > 1 request, waiting for their leader's prompt.

The first sample (the leader) is queued alone; the others (followers) wait here. Once the
leader has computed all but the last prompt token, each follower forks those blocks (shared,
reference-counted) and joins the head of the waiting queue, computing only the last prompt
token itself, so it samples its own first token; the partly filled last block is copied on
write. A leader that ends before that lets its followers run on their own.

Invariant: a follower is in exactly one leader's list while it waits here, and in no queue.
"""

from __future__ import annotations

from collections import deque

from tokenmill.core.kv_cache_manager import KVCacheManager
from tokenmill.core.request import Request


class SampleGroups:
    def __init__(self) -> None:
        self._followers: dict[str, list[Request]] = {}  # leader id → samples waiting to fork
        self._leader_of: dict[str, str] = {}  # follower id → leader id

    def __bool__(self) -> bool:
        return bool(self._followers)

    def add(self, leader: Request, followers: list[Request]) -> None:
        self._followers[leader.request_id] = list(followers)
        for f in followers:
            self._leader_of[f.request_id] = leader.request_id

    def remove_follower(self, request_id: str) -> bool:
        """Drop a waiting follower (it ended); whether it was one."""
        leader = self._leader_of.pop(request_id, None)
        if leader is None:
            return False
        self._followers[leader] = [f for f in self._followers[leader]
                                   if f.request_id != request_id]
        return True

    def maybe_fork(self, leader: Request, kv: KVCacheManager, waiting: deque[Request]) -> None:
        """Once the leader's scheduled step writes its prompt[:-1], its followers share those
        blocks and queue at the head, running from the next step on. NOTE: sharing blocks whose
        K/V this very step writes is safe because the followers are not scheduled before this
        step's forward pass has run."""
        if leader.request_id not in self._followers:
            return
        shared = leader.num_prompt_tokens - 1
        if leader.num_computed_tokens < shared:
            return
        followers = self._followers.pop(leader.request_id)
        for f in followers:
            del self._leader_of[f.request_id]
            kv.fork(leader, f, num_tokens=shared)
            f.num_computed_tokens = shared
        waiting.extendleft(reversed(followers))

    def release(self, leader: Request, waiting: deque[Request]) -> None:
        """A leader that ends before forking lets its followers run on their own."""
        followers = self._followers.pop(leader.request_id, [])
        for f in followers:
            del self._leader_of[f.request_id]
        waiting.extendleft(reversed(followers))
