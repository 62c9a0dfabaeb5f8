"""PrefixOffers: what each live request has given the prefix cache, and what it keeps locked.

A request's full blocks are offered to the radix tree as soon as the step that fills them is
scheduled (core/kv_cache_manager.py says why that is safe). For each request this keeps:
- `num_offered[rid]`: its leading blocks already offered (a hit's blocks count: they came
  from the tree), so that each block is offered once;
- `handles[rid]`: the tree node its cached path ends at, locked while the request lives so
  that eviction never takes blocks a request uses.

Invariants: a request's handle is locked exactly once by it (`lock` locks the new node before
unlocking the old, so a shared path never drops to zero between the two); the tree holds one
reference on each block it adopted from an offer, taken here (`pool.incr_ref`); `forget`
undoes both maps and the lock, never the tree's references (cached blocks stay cached).
"""

from __future__ import annotations

from tokenmill.core.block_pool import BlockPool, KVBlock
from tokenmill.core.radix_cache import RadixCache, RadixNode
from tokenmill.core.request import Request
from tokenmill.kv_offload.manager import OffloadManager


class PrefixOffers:
    def __init__(self, tree: RadixCache, pool: BlockPool, block_size: int,
                 sliding_window: int | None, offload: OffloadManager | None) -> None:
        self.tree, self.pool, self.block_size = tree, pool, block_size
        self.sliding_window = sliding_window
        self.offload = offload
        self.handles: dict[str, RadixNode] = {}  # the locked tree node of each request
        self.num_offered: dict[str, int] = {}  # leading blocks already offered to the tree

    def adopt_hit(self, rid: str, handle: RadixNode | None, num_blocks: int) -> None:
        """A new request starts from a cache hit of `num_blocks` blocks ending at `handle`."""
        self.lock(rid, handle)
        self.num_offered[rid] = num_blocks

    def inherit(self, parent: str, child: str, num_full_blocks: int) -> None:
        """A forked child shares the parent's first `num_full_blocks` full blocks."""
        self.lock(child, self.handles.get(parent))
        self.num_offered[child] = min(self.num_offered.get(parent, 0), num_full_blocks)

    def forget(self, rid: str) -> None:
        """The request released its blocks: unlock its path and drop its counts."""
        handle = self.handles.pop(rid, None)
        if handle is not None:
            self.tree.lock_handle(handle, unlock=True)
        self.num_offered.pop(rid, None)

    def offer(self, request: Request, blocks: list[KVBlock], num_tokens: int) -> None:
        """Insert the request's blocks (its table, `blocks`) that are full once `num_tokens`
        are computed."""
        rid, bs, ns = request.request_id, self.block_size, request.lora_key
        num_full = num_tokens // bs
        offered = self.num_offered.get(rid, 0)
        if num_full <= offered:
            return
        ids = None  # the full blocks' ids, built once if needed
        if self.offload is not None and self.offload.publishes:
            ids = [b.block_id for b in blocks[:num_full]]
            self._publish(request, ids, offered)
        if self._extend(request, blocks, offered, num_full):
            return
        tokens = request.all_token_ids[:num_full * bs]
        if ids is None:
            ids = [b.block_id for b in blocks[:num_full]]
        null = self.pool.null_block.block_id
        if null in ids:  # blocks dropped out of the window: offer on only where the tree
            last = len(ids) - 1 - ids[::-1].index(null)  # holds their tokens already
            if len(self.tree.match_prefix(tokens[:(last + 1) * bs], ns).block_ids) <= last:
                self.num_offered[rid] = num_full  # (the tree lost them: stop offering)
                return
        result = self.tree.insert_prefix(tokens, ids, ns)
        self.pool.incr_ref(blocks[result.cached_len // bs:num_full])  # the tree's references
        handle = result.handle
        if result.cached_len == len(tokens):
            # NOTE: nothing adopted. If the tree held some of these tokens under other blocks
            # (computed by another request), lock only as deep as the blocks we really share,
            # so we do not pin cached blocks we never use.
            tree_ids = self.tree.match_prefix(tokens, ns).block_ids
            shared = next((i for i, (a, b) in enumerate(zip(tree_ids, ids, strict=True))
                           if a != b and b != null), len(ids))
            if shared < len(ids):
                handle = (self.tree.match_prefix(tokens[:shared * bs], ns).handle if shared
                          else None)
        self.lock(rid, handle)
        self.num_offered[rid] = num_full

    def _extend(self, request: Request, blocks: list[KVBlock], offered: int,
                num_full: int) -> bool:
        """Offer blocks offered..num_full as the continuation of the request's locked node,
        when that node ends where its offered blocks do (it does after each offer that
        adopted blocks: a decoding request's every newly full block) and nothing cached
        continues it the same way; whether it did. insert_prefix would match the whole path
        from the root again: ~40 µs at a 600-token context, once per block filled."""
        handle = self.handles.get(request.request_id)
        if (handle is None or self.sliding_window is not None
                or handle.end != offered * self.block_size):
            return False
        new = blocks[offered:num_full]
        tokens = request.all_token_ids[offered * self.block_size:num_full * self.block_size]
        result = self.tree.extend(handle, tokens, [b.block_id for b in new], request.lora_key)
        if result is None:
            return False
        self.pool.incr_ref(new)  # the tree's references
        self.lock(request.request_id, result.handle)
        self.num_offered[request.request_id] = num_full
        return True

    def _publish(self, request: Request, block_ids: list[int], first: int) -> None:
        """Hand a producer's newly full prompt blocks to the KV transfer."""
        end = min(len(block_ids), request.num_prompt_tokens // self.block_size)
        if end > first:
            keys = self.offload.keys(request.request_id, request.all_token_ids,
                                     request.lora_key, end)
            self.offload.on_prompt_computed(keys[first:end], block_ids[first:end])

    def lock(self, rid: str, handle: RadixNode | None) -> None:
        """Make `handle` the request's locked node (lock the new before unlocking the old);
        None (or the root) leaves it locking nothing."""
        if handle is not None and handle is not self.tree.root:
            self.tree.lock_handle(handle)
        old = self.handles.pop(rid, None)
        if old is not None:
            self.tree.lock_handle(old, unlock=True)
        if handle is not None and handle is not self.tree.root:
            self.handles[rid] = handle
