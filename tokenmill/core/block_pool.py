"""BlockPool: the fixed set of KV-cache blocks, their reference counts and the free queue.

Invariants (checked by `check_integrity`):
- Block 0 is the null block: never handed out, used to pad block tables.
- A block is in the free queue iff its `ref_cnt == 0`.
- free + in use == num_blocks - 1 (the null block is neither).

Free blocks are of two kinds: blocks never handed out yet (a flag per id, taken in id order by
a cursor that only moves up) and blocks freed since (an insertion-ordered dict: O(1) pop,
append and removal by id). Taking the lowest fresh id from a dict instead (`next(iter(d))`
after popping its first entries) walks every entry deleted before it: quadratic, 2.8 s of host
time to hand out 100,000 blocks once (an H200 holds ~300,000 of SmolLM2's). Allocation takes
the most recently freed block first and a fresh one only when none is left: recently used
blocks are resident and warm, while a fresh block's first write page-faults its memory in
(about 15 ms of a 128-token prefill on CPU when every request got fresh blocks). Cached
prefixes never sit here: the radix tree holds a reference to each of its blocks and evicts them
in LRU order.
"""

from __future__ import annotations

from collections.abc import Iterable


class KVBlock:
    __slots__ = ("block_id", "ref_cnt")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0

    def __repr__(self) -> str:
        return f"KVBlock({self.block_id}, ref={self.ref_cnt})"


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 2:
            raise ValueError(f"the KV cache needs at least 2 blocks (one is the null block), "
                             f"got {num_blocks}")
        self.num_blocks = num_blocks
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.null_block = self.blocks[0]
        self.null_block.ref_cnt = 1  # pinned forever
        self._is_fresh = bytearray(b"\x01") * num_blocks  # never handed out
        self._is_fresh[0] = 0
        self._num_fresh = num_blocks - 1
        self._next_fresh = 1  # no fresh block has a lower id
        self._recycled: dict[int, KVBlock] = {}

    @property
    def num_free_blocks(self) -> int:
        return self._num_fresh + len(self._recycled)

    @property
    def usage(self) -> float:
        """Fraction of usable blocks in use, in [0, 1]."""
        return 1.0 - self.num_free_blocks / (self.num_blocks - 1)

    def get_new_blocks(self, n: int) -> list[KVBlock]:
        """Take `n` free blocks (ref_cnt 1 each). The caller checks `num_free_blocks` first."""
        if n > self.num_free_blocks:
            raise RuntimeError(f"asked for {n} blocks with only {self.num_free_blocks} free")
        out = []
        for _ in range(n):
            if self._recycled:
                _, block = self._recycled.popitem()  # the most recently freed
            else:
                block = self.blocks[self._take_fresh()]  # the lowest fresh id
            block.ref_cnt = 1
            out.append(block)
        return out

    def _take_fresh(self) -> int:
        while not self._is_fresh[self._next_fresh]:
            self._next_fresh += 1
        self._is_fresh[self._next_fresh] = 0
        self._num_fresh -= 1
        return self._next_fresh

    def incr_ref(self, blocks: Iterable[KVBlock]) -> None:
        for b in blocks:
            if b.ref_cnt == 0 and self._recycled.pop(b.block_id, None) is None:
                self._is_fresh[b.block_id] = 0  # (a fresh block taken out of turn)
                self._num_fresh -= 1
            b.ref_cnt += 1

    def free_blocks(self, blocks: Iterable[KVBlock]) -> None:
        """Drop one reference from each block; blocks reaching 0 become free, the last of
        them the first to be handed out again."""
        for b in blocks:
            if b.ref_cnt <= 0 or b is self.null_block:
                raise RuntimeError(f"double free of {b}")
            b.ref_cnt -= 1
            if b.ref_cnt == 0:
                self._recycled[b.block_id] = b

    def check_integrity(self) -> None:
        """Raise AssertionError when the pool's invariants do not hold."""
        in_use = sum(1 for b in self.blocks[1:] if b.ref_cnt > 0)
        if in_use + self.num_free_blocks != self.num_blocks - 1:
            raise AssertionError(f"block accounting broken: {in_use} in use + "
                                 f"{self.num_free_blocks} free != {self.num_blocks - 1}")
        fresh = [i for i, flag in enumerate(self._is_fresh) if flag]
        if len(fresh) != self._num_fresh or (fresh and fresh[0] < self._next_fresh):
            raise AssertionError("the fresh blocks' count or cursor is wrong")
        if set(fresh) & self._recycled.keys():
            raise AssertionError("a block is both fresh and recycled")
        for b in [*(self.blocks[i] for i in fresh), *self._recycled.values()]:
            if b.ref_cnt != 0:
                raise AssertionError(f"{b} is in the free queue with references")
        if self.null_block.ref_cnt != 1:
            raise AssertionError("the null block's pin was lost")
