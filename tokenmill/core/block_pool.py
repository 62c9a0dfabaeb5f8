"""BlockPool: the fixed set of KV-cache blocks, their reference counts and the free queue.

Invariants (checked by `check_integrity`):
- Block 0 is the null block: never handed out, used to pad block tables.
- A block is in the free queue iff its `ref_cnt == 0`.
- free + in use == num_blocks - 1 (the null block is neither).

The free queue is an insertion-ordered dict: O(1) pop from the head (allocation), O(1) append
at the tail (free) and O(1) removal of any block by id, which prefix caching needs to revive a
freed-but-still-cached block. Blocks are allocated from the head, so the head holds the least
recently freed blocks: the eviction order an LRU prefix cache wants.
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
        self._free: dict[int, KVBlock] = {b.block_id: b for b in self.blocks[1:]}

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of usable blocks in use, in [0, 1]."""
        return 1.0 - self.num_free_blocks / (self.num_blocks - 1)

    def get_new_blocks(self, n: int) -> list[KVBlock]:
        """Take `n` free blocks (ref_cnt 1 each). The caller checks `num_free_blocks` first."""
        if n > len(self._free):
            raise RuntimeError(f"asked for {n} blocks with only {len(self._free)} free")
        out = []
        for _ in range(n):
            block_id = next(iter(self._free))
            block = self._free.pop(block_id)
            block.ref_cnt = 1
            out.append(block)
        return out

    def incr_ref(self, blocks: Iterable[KVBlock]) -> None:
        for b in blocks:
            if b.ref_cnt == 0:
                del self._free[b.block_id]
            b.ref_cnt += 1

    def free_blocks(self, blocks: Iterable[KVBlock]) -> None:
        """Drop one reference from each block; blocks reaching 0 join the free queue's tail.

        Pass blocks in the order they should be evicted (callers pass a request's blocks
        tail first, so a sequence's last blocks are reused before its first ones).
        """
        for b in blocks:
            if b.ref_cnt <= 0 or b is self.null_block:
                raise RuntimeError(f"double free of {b}")
            b.ref_cnt -= 1
            if b.ref_cnt == 0:
                self._free[b.block_id] = b

    def check_integrity(self) -> None:
        """Raise AssertionError when the pool's invariants do not hold."""
        in_use = sum(1 for b in self.blocks[1:] if b.ref_cnt > 0)
        if in_use + len(self._free) != self.num_blocks - 1:
            raise AssertionError(f"block accounting broken: {in_use} in use + {len(self._free)} "
                                 f"free != {self.num_blocks - 1}")
        for b in self._free.values():
            if b.ref_cnt != 0:
                raise AssertionError(f"{b} is in the free queue with references")
        if self.null_block.ref_cnt != 1:
            raise AssertionError("the null block's pin was lost")
