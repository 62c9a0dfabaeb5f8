"""RadixCache: a radix tree over token ids at block granularity, mapping cached prefixes to the
KV blocks that hold them. It knows nothing of the block pool: values are opaque block ids.

    root ── [sys prompt: blocks 3,4,5,6] ─┬─ [user A: 9,10] ── [turn 2: 14]
                                          └─ [user B: 11]

Each edge holds a whole number of blocks (len(key) == len(value) * block_size), and a node's
children are keyed by their namespace and the tokens of their first block, so two children never
share a first block. A namespace (a LoRA adapter's key; None for the base model) is a separate
tree under the same root: the same tokens under two namespaces never share a node, and every
node below the root keeps its parent's namespace. Contract:

- `match_prefix(ids, namespace)` → MatchResult: the longest cached prefix of `ids` in whole
  blocks, its block ids, and a handle (the deepest node, split at the match end if needed).
- `lock_handle(h)` / `lock_handle(h, unlock=True)`: +1 / -1 on every node from h up to the root.
  Locked nodes are never evicted; the caller locks what its requests are using.
- `insert_prefix(ids, block_ids, namespace)` → InsertResult(cached_len, handle): adds the
  blocks of a prefix; the leading `cached_len` tokens were already cached, and for those the
  tree keeps its own blocks (the caller's are not adopted). The blocks after `cached_len` now
  belong to the tree.
- `extend(node, ids, block_ids, namespace)`: the same for blocks that continue `node`'s path
  (a running request's newly full blocks after its locked handle), without walking the path
  from the root: O(new blocks + the path's nodes), not O(the path's tokens). None, changing
  nothing, when `node` has a child with the same first block (insert_prefix then finds what
  is shared).
- `evict(n)` → freed block ids (at least n if possible): whole unlocked leaves, least recently
  used first; a parent left childless and unlocked becomes a candidate in turn.

Invariants (`check_integrity`): key/value lengths agree; lock counts are >= 0 and a parent's
count is at least each child's; `num_cached_blocks` and `num_evictable_blocks` match the tree;
a node's `end` is the length of its path from the root (a split keeps the lower half's).
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field

_clock = itertools.count()


@dataclass(eq=False)
class RadixNode:
    key: tuple[int, ...] = ()
    value: list[int] = field(default_factory=list)  # block ids
    parent: RadixNode | None = None
    children: dict[tuple[int, ...], RadixNode] = field(default_factory=dict)
    lock_ref: int = 0
    last_access: int = 0
    namespace: str | None = None  # whose KV the blocks hold (a LoRA adapter's key, or None)
    end: int = 0  # tokens from the root to the end of this node's key

    def __lt__(self, other: RadixNode) -> bool:  # heap order: least recently used first
        return self.last_access < other.last_access


@dataclass
class MatchResult:
    handle: RadixNode
    block_ids: list[int]

    def num_tokens(self, block_size: int) -> int:
        return len(self.block_ids) * block_size


@dataclass
class InsertResult:
    cached_len: int  # tokens that were already in the tree
    handle: RadixNode


class RadixCache:
    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.root = RadixNode()
        self.root.lock_ref = 1  # never evicted
        self.num_cached_blocks = 0
        self.num_evictable_blocks = 0  # blocks in nodes with lock_ref == 0

    def _child_key(self, namespace: str | None, key: tuple[int, ...] | list[int],
                   start: int = 0) -> tuple[str | None, tuple[int, ...]]:
        """How a parent files a child: its namespace and its first block's tokens."""
        return namespace, tuple(key[start:start + self.block_size])

    def _filed(self, node: RadixNode) -> tuple[str | None, tuple[int, ...]]:
        return self._child_key(node.namespace, node.key)

    # ---- lookup -----------------------------------------------------------------------------
    def match_prefix(self, token_ids: list[int], namespace: str | None = None) -> MatchResult:
        bs = self.block_size
        usable = len(token_ids) - len(token_ids) % bs
        node, pos, blocks = self.root, 0, []
        now = next(_clock)
        node.last_access = now
        while pos < usable:
            child = node.children.get(self._child_key(namespace, token_ids, pos))
            if child is None:
                break
            n = self._common_blocks(child.key, token_ids, pos, usable)
            if n < len(child.value):
                child = self._split(child, n)
            blocks += child.value
            pos += n * bs
            node = child
            node.last_access = now
        return MatchResult(node, blocks)

    def _common_blocks(self, key: tuple[int, ...], ids: list[int], pos: int, end: int) -> int:
        """How many whole blocks of `key` equal ids[pos:end] (at least 1: the child's key)."""
        bs, n = self.block_size, 0
        while (n + 1) * bs <= len(key) and pos + (n + 1) * bs <= end and \
                key[n * bs:(n + 1) * bs] == tuple(ids[pos + n * bs:pos + (n + 1) * bs]):
            n += 1
        return n

    def _split(self, node: RadixNode, n_blocks: int) -> RadixNode:
        """Cut `node` after n_blocks; return the new upper half (which keeps the lock count)."""
        cut = n_blocks * self.block_size
        parent = node.parent
        upper = RadixNode(key=node.key[:cut], value=node.value[:n_blocks], parent=parent,
                          lock_ref=node.lock_ref, last_access=node.last_access,
                          namespace=node.namespace, end=parent.end + cut)
        parent.children[self._filed(upper)] = upper
        node.key, node.value, node.parent = node.key[cut:], node.value[n_blocks:], upper
        upper.children[self._filed(node)] = node
        return upper

    # ---- locking ----------------------------------------------------------------------------
    def lock_handle(self, handle: RadixNode, unlock: bool = False) -> None:
        node: RadixNode | None = handle
        while node is not None and node is not self.root:
            if unlock:
                node.lock_ref -= 1
                if node.lock_ref < 0:
                    raise RuntimeError("radix node unlocked more often than locked")
                if node.lock_ref == 0:
                    self.num_evictable_blocks += len(node.value)
            else:
                if node.lock_ref == 0:
                    self.num_evictable_blocks -= len(node.value)
                node.lock_ref += 1
            node = node.parent

    # ---- insertion --------------------------------------------------------------------------
    def insert_prefix(self, token_ids: list[int], block_ids: list[int],
                      namespace: str | None = None) -> InsertResult:
        bs = self.block_size
        if len(token_ids) != len(block_ids) * bs:
            raise ValueError(f"{len(token_ids)} tokens do not fill {len(block_ids)} blocks")
        match = self.match_prefix(token_ids, namespace)
        cached = len(match.block_ids)
        node = match.handle
        if cached < len(block_ids):
            node = self._add_child(match.handle, token_ids[cached * bs:], block_ids[cached:],
                                   namespace, next(_clock))
        return InsertResult(cached * bs, node)

    def extend(self, node: RadixNode, token_ids: list[int], block_ids: list[int],
               namespace: str | None = None) -> InsertResult | None:
        """Cache blocks continuing `node`'s path (token_ids: theirs only), as insert_prefix of
        the whole path would, touching the path as a match does; None when `node` is the root
        or has a child with the same first block."""
        if len(token_ids) != len(block_ids) * self.block_size:
            raise ValueError(f"{len(token_ids)} tokens do not fill {len(block_ids)} blocks")
        if node is self.root or self._child_key(namespace, token_ids) in node.children:
            return None
        now = next(_clock)
        up: RadixNode | None = node
        while up is not None:
            up.last_access = now
            up = up.parent
        return InsertResult(node.end, self._add_child(node, token_ids, block_ids, namespace,
                                                      now))

    def _add_child(self, parent: RadixNode, token_ids: list[int], block_ids: list[int],
                   namespace: str | None, now: int) -> RadixNode:
        node = RadixNode(key=tuple(token_ids), value=list(block_ids), parent=parent,
                         last_access=now, namespace=namespace,
                         end=parent.end + len(token_ids))
        parent.children[self._filed(node)] = node
        self.num_cached_blocks += len(node.value)
        self.num_evictable_blocks += len(node.value)
        return node

    # ---- eviction ---------------------------------------------------------------------------
    def evict(self, num_blocks: int,
              on_evict: Callable[[RadixNode], None] | None = None) -> list[int]:
        """`on_evict(node)`: told of each node before it is detached (KV tiers save its
        blocks, kv_offload/manager.py)."""
        leaves = [n for n in self.nodes() if not n.children and n.lock_ref == 0]
        heapq.heapify(leaves)
        freed: list[int] = []
        while len(freed) < num_blocks and leaves:
            node = heapq.heappop(leaves)
            if on_evict is not None:
                on_evict(node)
            freed += node.value
            parent = node.parent
            del parent.children[self._filed(node)]
            self.num_cached_blocks -= len(node.value)
            self.num_evictable_blocks -= len(node.value)
            if parent is not self.root and not parent.children and parent.lock_ref == 0:
                heapq.heappush(leaves, parent)
        return freed

    def path_tokens(self, node: RadixNode) -> list[int]:
        """The tokens from the root to the end of `node` (its whole prefix)."""
        parts = []
        while node is not None and node is not self.root:
            parts.append(node.key)
            node = node.parent
        return [t for part in reversed(parts) for t in part]

    def nodes(self) -> list[RadixNode]:
        """Every node but the root."""
        out, stack = [], list(self.root.children.values())
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(node.children.values())
        return out

    def cached_block_ids(self) -> list[int]:
        return [b for n in self.nodes() for b in n.value]

    def check_integrity(self) -> None:
        cached = evictable = 0
        for node in self.nodes():
            if len(node.key) != len(node.value) * self.block_size or not node.value:
                raise AssertionError(f"node key/value mismatch: {len(node.key)} tokens, "
                                     f"{len(node.value)} blocks")
            if node.lock_ref < 0 or node.lock_ref > node.parent.lock_ref and \
                    node.parent is not self.root:
                raise AssertionError("a child is locked more than its parent")
            if node.parent.children.get(self._filed(node)) is not node or (
                    node.parent is not self.root and node.namespace != node.parent.namespace):
                raise AssertionError("a node is filed under the wrong key")
            if node.end != node.parent.end + len(node.key):
                raise AssertionError("a node's end is not its path's length")
            cached += len(node.value)
            evictable += len(node.value) if node.lock_ref == 0 else 0
        if (cached, evictable) != (self.num_cached_blocks, self.num_evictable_blocks):
            raise AssertionError(f"counts drifted: cached {cached} vs "
                                 f"{self.num_cached_blocks}, evictable {evictable} vs "
                                 f"{self.num_evictable_blocks}")
