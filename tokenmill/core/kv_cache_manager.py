"""KVCacheManager: the scheduler's only view of KV memory.

The scheduler calls `get_computed_blocks` (prefix-cache hit), `allocate_slots` (None means
"no room: preempt someone and retry"), `fork`, `swap_out` / `swap_in` and `free`.

Reference counts: each request holds one reference on every block of its block table, and the
radix tree holds one on every block it caches. A request's full blocks are offered to the tree
as soon as the step that fills them is scheduled (the K/V of a step is written before any
attention reads it, so a request admitted in the same step may already share them). The tree
node path covering a request's cached blocks is locked while the request lives, so evictable
(unlocked) tree blocks are exactly those no request holds: they count as free, and
`allocate_slots` evicts them LRU when the pool runs dry. The offers and the locks are kept
by core/prefix_offers.py (`self.offers`).

A request's blocks are cached under its LoRA adapter's key (`Request.lora_key`; None for the
base model): the same tokens under another adapter are other K/V and never a hit.

KV tiers (kv_offload/manager.py, when configured): blocks the tree evicts are saved below it,
and a request's hit continues past the tree into host memory (blocks copied back in before the
step's forward pass, then offered to the tree as computed); a request whose next blocks are in
files waits while they are read (`ComputedBlocks.wait_for_kv`).

Copy-on-write: before a request writes into a shared, partly filled block (after `fork`) it
gets a private copy; the (src, dst) pair is queued for the runner to copy before the forward.

Sliding window (every layer attends only its last `sliding_window` tokens, as Mistral's): a
block whose every token lies before the window of the request's next query is dropped, its
place in the block table taken by the null block (the backends mask those positions), so a
long sequence holds about window / block_size blocks. Dropped blocks were offered to the
prefix cache before (a block is offered when filled, dropped a window later), so the tree
keeps them for prefix hits and evicts them LRU like any other.

Slot arithmetic for one request, block_size = 4, 6 tokens computed, 3 new tokens:

    block table:  [ b7 ][ b2 ][ b9 ]
    tokens:       0123  45|67  8
                        ^ computed | new (written this step into slots of b2 and b9)
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tokenmill.core.block_pool import BlockPool, KVBlock
from tokenmill.core.prefix_offers import PrefixOffers
from tokenmill.core.radix_cache import RadixCache, RadixNode
from tokenmill.core.request import Request
from tokenmill.core.swap_space import SwapSpace
from tokenmill.kv_offload.manager import OffloadHit, OffloadManager
from tokenmill.kv_offload.ops import OffloadOps
from tokenmill.utils import cdiv


@dataclass
class ComputedBlocks:
    """A prefix-cache hit: blocks holding the first `num_tokens` tokens of a request."""

    blocks: list[KVBlock] = field(default_factory=list)
    num_tokens: int = 0  # the tree's blocks and the offloaded hit's
    handle: RadixNode | None = None
    offloaded: OffloadHit | None = None  # blocks after the tree's, copied in from host memory
    wait_for_kv: bool = False  # blocks after these are being read from files: start later


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False,
                 num_swap_blocks: int = 0, sliding_window: int | None = None,
                 offload: OffloadManager | None = None) -> None:
        if offload is not None and (not enable_prefix_caching or sliding_window is not None):
            raise ValueError("KV offloading needs prefix caching and a model without a "
                             "sliding window")
        self.block_size = block_size
        self.offload = offload
        self.sliding_window = sliding_window
        self.pool = BlockPool(num_blocks)
        self.tree = RadixCache(block_size) if enable_prefix_caching else None
        self.swap = SwapSpace(num_swap_blocks)
        self.req_to_blocks: dict[str, list[KVBlock]] = {}
        # what each request offered the tree and keeps locked (None without prefix caching)
        self.offers = (PrefixOffers(self.tree, self.pool, block_size, sliding_window, offload)
                       if self.tree is not None else None)
        self._pending_copies: list[tuple[int, int]] = []
        # requests whose table had entries replaced since it was last sent to the runner, not
        # only appended to (copy on write, the window's null blocks, a table given anew):
        # only theirs must be compared whole with what the runner holds (pop_rewritten)
        self._rewritten: set[str] = set()
        self.prefix_queries = 0  # prompt tokens of admitted requests
        self.prefix_hits = 0  # of which found in the cache
        self.prefix_cache_suspended = False  # see suspend_prefix_cache

    # ---- capacity ---------------------------------------------------------------------------
    @property
    def num_usable_blocks(self) -> int:
        return self.pool.num_blocks - 1

    @property
    def num_free_blocks(self) -> int:
        """Blocks a request could get now: free ones plus cached ones nobody uses."""
        evictable = self.tree.num_evictable_blocks if self.tree else 0
        return self.pool.num_free_blocks + evictable

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_usable_blocks

    def _make_room(self, n: int) -> bool:
        short = n - self.pool.num_free_blocks
        if short > 0 and self.tree is not None:
            self._evict(short)
        return n <= self.pool.num_free_blocks

    def _evict(self, num_blocks: int, save: bool = True) -> None:
        """Evict up to `num_blocks` cached blocks (LRU) from the tree and return them to the
        pool, last-first: the pool hands the most recently freed out first, so the next
        request gets them in their old order."""
        save = self.offload is not None and not self.prefix_cache_suspended and save
        freed = self.tree.evict(num_blocks, self._save_evicted if save else None)
        self.pool.free_blocks(self.pool.blocks[b] for b in reversed(freed))

    def _save_evicted(self, node: RadixNode) -> None:
        keys = self.offload.path_keys(self.tree.path_tokens(node), node.namespace)
        self.offload.on_evict(keys[-len(node.value):], node.value)

    # ---- prefix cache -----------------------------------------------------------------------
    def get_computed_blocks(self, request: Request) -> ComputedBlocks:
        """The longest cached prefix of the request, in whole blocks. At least one token is
        left to compute: its logits are what the request samples from next."""
        if (self.tree is None or self.prefix_cache_suspended
                or request.request_id in self.req_to_blocks
                or request.needs_every_prompt_position):
            return ComputedBlocks()
        match = self.tree.match_prefix(request.all_token_ids[:request.num_tokens - 1],
                                       request.lora_key)
        blocks = [self.pool.blocks[b] for b in match.block_ids]
        computed = ComputedBlocks(blocks, len(blocks) * self.block_size, match.handle)
        if self.offload is not None:
            self._offloaded_hit(request, computed)
        return computed

    def _offloaded_hit(self, request: Request, computed: ComputedBlocks) -> None:
        """Extend a tree hit with the request's next blocks found in host memory, or mark it
        waiting for those being read from files."""
        usable = (request.num_tokens - 1) // self.block_size
        first = len(computed.blocks)
        keys = self.offload.keys(request.request_id, request.all_token_ids, request.lora_key,
                                 usable)[first:]
        hit = self.offload.lookup(keys)
        computed.wait_for_kv = self.offload.must_wait(request.request_id,
                                                      keys[len(hit.slots):])
        if hit.slots:
            computed.offloaded = hit
            computed.num_tokens += len(hit.slots) * self.block_size

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix (vLLM's `reset_prefix_cache`), so that the next prompts
        are computed from scratch (benchmarks of cold prefill). Only while no request holds
        blocks, so that nothing in use is dropped; returns whether the cache was reset."""
        if self.tree is None:
            return True
        if self.req_to_blocks or self.tree.num_evictable_blocks != self.tree.num_cached_blocks:
            return False
        self._evict(self.tree.num_cached_blocks, save=False)
        if self.offload is not None:
            self.offload.clear_host()
        self.prefix_cache_suspended = False
        return True

    def suspend_prefix_cache(self) -> None:
        """Stop serving cache hits until the next reset: after a failed step, blocks offered
        to the tree may hold K/V that was never written."""
        self.prefix_cache_suspended = self.tree is not None

    # ---- allocation -------------------------------------------------------------------------
    def allocate_slots(self, request: Request, num_new_tokens: int,
                       computed: ComputedBlocks | None = None) -> list[int] | None:
        """Make room for `num_new_tokens` after the computed ones (the request's own, or the
        cache hit `computed` for a request that holds no blocks yet).

        Returns the ids of newly allocated blocks (possibly empty), or None when the pool
        cannot supply them, in which case nothing changed.
        """
        rid = request.request_id
        blocks = self.req_to_blocks.get(rid)
        is_new = blocks is None
        num_computed, hit = request.num_computed_tokens, None
        if is_new:
            blocks = self.req_to_blocks[rid] = []
            if computed is not None:
                num_computed, hit = self._adopt(request, blocks, computed)
        if (self.sliding_window is not None
                and self._drop_out_of_window(blocks, min(num_computed, request.num_tokens))):
            self._rewritten.add(rid)
        num_new_blocks = cdiv(num_computed + num_new_tokens, self.block_size) - len(blocks)
        # Copy-on-write: the block receiving the next token is shared and partly filled.
        cow_index = num_computed // self.block_size
        needs_cow = (num_new_tokens > 0 and num_computed % self.block_size != 0
                     and cow_index < len(blocks) and blocks[cow_index].ref_cnt > 1)
        new_ids = []
        if num_new_blocks > 0 or needs_cow:  # (a decode inside its last block needs neither)
            num_new_blocks = max(0, num_new_blocks)
            if not self._make_room(num_new_blocks + int(needs_cow)):
                if hit is not None:
                    self.offload.pin(hit.slots, unpin=True)
                if is_new:
                    self.free(request)
                return None
            if needs_cow:
                shared = blocks[cow_index]
                (copy,) = self.pool.get_new_blocks(1)
                self.pool.free_blocks([shared])
                blocks[cow_index] = copy
                self._rewritten.add(rid)
                self._pending_copies.append((shared.block_id, copy.block_id))
                new_ids.append(copy.block_id)
            new_blocks = self.pool.get_new_blocks(num_new_blocks)
            blocks.extend(new_blocks)
            new_ids.extend(b.block_id for b in new_blocks)
            if hit is not None:  # the hit's blocks are the first new ones
                self.offload.load(rid, hit, [b.block_id for b in new_blocks[:len(hit.slots)]])
        if is_new and request.num_computed_tokens == 0 and request.num_preemptions == 0:
            self.prefix_queries += request.num_prompt_tokens
            self.prefix_hits += min(num_computed, request.num_prompt_tokens)
        # Only verified tokens enter the prefix cache: drafts past num_tokens are not offered.
        if self.offers is not None:
            self.offers.offer(request, blocks,
                              min(num_computed + num_new_tokens, request.num_tokens))
        return new_ids

    def _adopt(self, request: Request, blocks: list[KVBlock], computed: ComputedBlocks
               ) -> tuple[int, OffloadHit | None]:
        """A new request's cache hit into its (empty) table `blocks`: the tree's blocks locked
        first, so that eviction cannot take them, and the host tier's slots pinned, so that
        it does not save evicted blocks into them; the tokens computed, and the host hit."""
        num_computed = request.num_computed_tokens
        if computed.num_tokens:
            self.offers.adopt_hit(request.request_id, computed.handle, len(computed.blocks))
            self.pool.incr_ref(computed.blocks)
            blocks.extend(computed.blocks)
            num_computed = computed.num_tokens
        if computed.offloaded is not None:
            self.offload.pin(computed.offloaded.slots)
        return num_computed, computed.offloaded

    def _drop_out_of_window(self, blocks: list[KVBlock], next_position: int) -> bool:
        """Put the null block in place of the blocks no query from `next_position` on will
        attend (keys at positions <= next_position - window), and release them; whether
        there were any. Only with a sliding window (the caller checks)."""
        first_needed = next_position - self.sliding_window + 1  # the window's first key
        dropped = []
        for i in range(min(max(0, first_needed) // self.block_size, len(blocks))):
            if blocks[i] is not self.pool.null_block:
                dropped.append(blocks[i])
                blocks[i] = self.pool.null_block
        self.pool.free_blocks(reversed(dropped))
        return bool(dropped)

    def _held(self, blocks: list[KVBlock]) -> list[KVBlock]:
        """The blocks a request references (its table without the null block's places)."""
        return [b for b in blocks if b is not self.pool.null_block]

    def fork(self, parent: Request, child: Request, num_tokens: int | None = None) -> None:
        """Let `child` share the blocks holding the parent's first `num_tokens` tokens (all of
        its blocks when None). The child must hold no blocks yet."""
        if self.req_to_blocks.get(child.request_id):
            raise ValueError(f"request {child.request_id!r} already holds blocks")
        blocks = self.req_to_blocks.get(parent.request_id, [])
        if num_tokens is not None:
            blocks = blocks[:cdiv(num_tokens, self.block_size)]
        blocks = list(blocks)
        self.pool.incr_ref(self._held(blocks))
        self.req_to_blocks[child.request_id] = blocks
        self._rewritten.add(child.request_id)
        if self.offers is not None:
            full = len(blocks) if num_tokens is None else num_tokens // self.block_size
            self.offers.inherit(parent.request_id, child.request_id, full)

    def free(self, request: Request) -> None:
        """Release the request's GPU blocks (tail first, so they are reused first) and swap
        blocks; blocks the prefix cache holds stay cached."""
        self._release_gpu_blocks(request.request_id)
        self.swap.free(request.request_id)

    def _release_gpu_blocks(self, rid: str) -> None:
        if self.offers is not None:
            self.offers.forget(rid)
        self.pool.free_blocks(reversed(self._held(self.req_to_blocks.pop(rid, []))))
        self._rewritten.discard(rid)  # (the runner drops it too: a later table is new)
        if self.offload is not None:
            self.offload.forget(rid)

    # ---- swapping ---------------------------------------------------------------------------
    def swap_out(self, request: Request) -> list[tuple[int, int]] | None:
        """Move the request's KV to swap space: (gpu, cpu) copies to do before the next
        forward pass, or None if the swap space cannot hold it (nothing changed)."""
        blocks = self.req_to_blocks.get(request.request_id, [])
        cpu = self.swap.allocate(request.request_id, len(blocks))
        if cpu is None:
            return None
        mapping = [(b.block_id, c) for b, c in zip(blocks, cpu, strict=True)]
        self._release_gpu_blocks(request.request_id)
        return mapping

    def swap_in(self, request: Request, num_new_tokens: int) -> list[tuple[int, int]] | None:
        """Bring a swapped request back with room for `num_new_tokens`: (cpu, gpu) copies,
        or None if the pool has no room now (nothing changed)."""
        cpu = self.swap.req_to_blocks[request.request_id]
        need = max(len(cpu), cdiv(request.num_computed_tokens + num_new_tokens,
                                  self.block_size))
        if not self._make_room(need):
            return None
        blocks = self.pool.get_new_blocks(len(cpu))
        copies = [(c, b.block_id) for c, b in zip(cpu, blocks, strict=True)]
        self.req_to_blocks[request.request_id] = blocks
        self._rewritten.add(request.request_id)
        self.swap.free(request.request_id)
        self.allocate_slots(request, num_new_tokens)  # fits: room was made for `need`
        return copies

    # ---- queries ----------------------------------------------------------------------------
    def get_block_ids(self, request_id: str, start: int = 0) -> list[int]:
        """The request's block table from entry `start` on."""
        return [b.block_id for b in self.req_to_blocks.get(request_id, [])[start:]]

    def num_table_blocks(self, request_id: str) -> int:
        return len(self.req_to_blocks.get(request_id, ()))

    def pop_rewritten(self, request_id: str) -> bool:
        """Whether the request's table changed otherwise than by appending since the last
        call for it (RunnerView asks as it sends the table; see _rewritten)."""
        if request_id in self._rewritten:
            self._rewritten.remove(request_id)
            return True
        return False

    def save_cached_blocks(self) -> OffloadOps | None:
        """The disk tier's copies of every block the prefix cache holds that it lacks (at
        shutdown, so that a new process finds them); None when there is nothing to save."""
        offload = self.offload
        if (offload is None or offload.config.disk_dir is None or self.tree is None
                or self.prefix_cache_suspended):
            return None
        for node in self.tree.nodes():
            self._save_evicted(node)
        return offload.take_ops() or None

    def take_offload_ops(self) -> OffloadOps | None:
        """Copies to and from the KV tiers for the runner to do around this step."""
        return None if self.offload is None else self.offload.take_ops()

    def take_pending_copies(self) -> list[tuple[int, int]]:
        """(src, dst) block copies the runner must do before this step's forward pass."""
        copies, self._pending_copies = self._pending_copies, []
        return copies

    def check_integrity(self) -> None:
        self.pool.check_integrity()
        self.swap.check_integrity()
        if self.offload is not None:
            self.offload.check_integrity()
        refs: dict[int, int] = {}
        for blocks in self.req_to_blocks.values():
            for b in self._held(blocks):
                refs[b.block_id] = refs.get(b.block_id, 0) + 1
        if self.tree is not None:
            self.tree.check_integrity()
            for b in self.tree.cached_block_ids():
                refs[b] = refs.get(b, 0) + 1
        for block in self.pool.blocks[1:]:
            if block.ref_cnt != refs.get(block.block_id, 0):
                raise AssertionError(f"block {block.block_id} has ref_cnt {block.ref_cnt}, "
                                     f"held {refs.get(block.block_id, 0)} times")
        if self.num_free_blocks > self.num_usable_blocks:
            raise AssertionError("more free blocks than exist: a cached block is counted "
                                 "evictable while a request holds it")
