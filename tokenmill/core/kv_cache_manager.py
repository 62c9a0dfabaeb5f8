"""KVCacheManager: the scheduler's only view of KV memory.

The scheduler calls `get_computed_blocks`, `allocate_slots` (None means "no room: preempt
someone and retry"), `fork` and `free`. Inside, each request owns a list of blocks (its block
table); blocks may be shared between requests (forks share their prefix) and are then
copied on write: before a request writes into a shared, partly filled block it gets a private
copy, and the (src, dst) pair is queued for the model runner to copy before the forward pass.

Slot arithmetic for one request, block_size = 4, 6 tokens computed, 3 new tokens:

    block table:  [ b7 ][ b2 ][ b9 ]
    tokens:       0123  45|67  8
                        ^ computed | new (written this step into slots of b2 and b9)
"""

from __future__ import annotations

from tokenmill.core.block_pool import BlockPool, KVBlock
from tokenmill.core.request import Request
from tokenmill.utils import cdiv


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self.req_to_blocks: dict[str, list[KVBlock]] = {}
        self._pending_copies: list[tuple[int, int]] = []

    @property
    def usage(self) -> float:
        return self.pool.usage

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def num_usable_blocks(self) -> int:
        return self.pool.num_blocks - 1

    def get_computed_blocks(self, request: Request) -> tuple[list[KVBlock], int]:
        """Blocks already holding a prefix of the request's tokens, and how many tokens that is.

        Without a prefix cache nothing is ever computed ahead of time.
        """
        return [], 0

    def allocate_slots(self, request: Request, num_new_tokens: int) -> list[int] | None:
        """Make room for `num_new_tokens` more tokens after `request.num_computed_tokens`.

        Returns the ids of newly allocated blocks (possibly empty), or None when the pool
        cannot supply them, in which case nothing changed.
        """
        blocks = self.req_to_blocks.setdefault(request.request_id, [])
        num_computed = request.num_computed_tokens
        num_required = cdiv(num_computed + num_new_tokens, self.block_size)
        num_new_blocks = max(0, num_required - len(blocks))
        # Copy-on-write: the block receiving the next token is shared and partly filled.
        cow_index = num_computed // self.block_size
        needs_cow = (num_new_tokens > 0 and num_computed % self.block_size != 0
                     and cow_index < len(blocks) and blocks[cow_index].ref_cnt > 1)
        if num_new_blocks + int(needs_cow) > self.pool.num_free_blocks:
            if not blocks:
                del self.req_to_blocks[request.request_id]
            return None
        new_ids = []
        if needs_cow:
            shared = blocks[cow_index]
            (copy,) = self.pool.get_new_blocks(1)
            self.pool.free_blocks([shared])
            blocks[cow_index] = copy
            self._pending_copies.append((shared.block_id, copy.block_id))
            new_ids.append(copy.block_id)
        new_blocks = self.pool.get_new_blocks(num_new_blocks)
        blocks.extend(new_blocks)
        new_ids.extend(b.block_id for b in new_blocks)
        return new_ids

    def fork(self, parent: Request, child: Request, num_tokens: int | None = None) -> None:
        """Let `child` share the blocks holding the parent's first `num_tokens` tokens (all of
        its blocks when None). The child must hold no blocks yet."""
        if self.req_to_blocks.get(child.request_id):
            raise ValueError(f"request {child.request_id!r} already holds blocks")
        blocks = self.req_to_blocks.get(parent.request_id, [])
        if num_tokens is not None:
            blocks = blocks[:cdiv(num_tokens, self.block_size)]
        blocks = list(blocks)
        self.pool.incr_ref(blocks)
        self.req_to_blocks[child.request_id] = blocks

    def free(self, request: Request) -> None:
        """Release the request's blocks (tail first, so they are reused first)."""
        blocks = self.req_to_blocks.pop(request.request_id, [])
        self.pool.free_blocks(reversed(blocks))

    def get_block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(request_id, [])]

    def take_pending_copies(self) -> list[tuple[int, int]]:
        """(src, dst) block copies the runner must do before this step's forward pass."""
        copies, self._pending_copies = self._pending_copies, []
        return copies

    def check_integrity(self) -> None:
        self.pool.check_integrity()
        refs: dict[int, int] = {}
        for blocks in self.req_to_blocks.values():
            for b in blocks:
                refs[b.block_id] = refs.get(b.block_id, 0) + 1
        for block_id, n in refs.items():
            if self.pool.blocks[block_id].ref_cnt != n:
                raise AssertionError(f"block {block_id} has ref_cnt "
                                     f"{self.pool.blocks[block_id].ref_cnt}, held {n} times")
        in_use = sum(1 for b in self.pool.blocks[1:] if b.ref_cnt > 0)
        if in_use != len(refs):
            raise AssertionError(f"{in_use} blocks in use but {len(refs)} held by requests")
