"""HostIndex: which host-memory slots hold which blocks (scheduler side; the runner owns the
tensor, kv_offload/worker.py). Pure bookkeeping.

A slot is free, or holds a block under its key (ready), or is reserved for a block being read
from a file (pending: not found by lookups until the runner confirms it). Ready slots are
reused least recently used first, except pinned ones: a slot a copy of this step reads from,
or a pending one, is never handed to another key before the runner has used it.

Invariant: free + ready + pending == num_slots; every pinned slot is ready or pending.
"""

from __future__ import annotations

from collections import OrderedDict


class HostIndex:
    def __init__(self, num_slots: int, first_slot: int = 0) -> None:
        self.num_slots = num_slots
        self._free = list(range(first_slot + num_slots - 1, first_slot - 1, -1))
        self._ready: OrderedDict[bytes, int] = OrderedDict()  # least recently used first
        self._pending: dict[bytes, int] = {}
        self._pins: dict[int, int] = {}  # slot → pin count

    def __len__(self) -> int:
        return len(self._ready)

    def lookup(self, key: bytes) -> int | None:
        """The slot holding `key`, marked recently used; None if it holds none."""
        slot = self._ready.get(key)
        if slot is not None:
            self._ready.move_to_end(key)
        return slot

    def num_available(self) -> int:
        """Slots `allocate` could hand out now (free, or ready and unpinned)."""
        return len(self._free) + sum(s not in self._pins for s in self._ready.values())

    def is_pending(self, key: bytes) -> bool:
        return key in self._pending

    def __contains__(self, key: bytes) -> bool:
        return key in self._ready or key in self._pending

    def allocate(self, key: bytes, pending: bool = False) -> int | None:
        """A slot for `key` (a free one, else the least recently used unpinned one); None if
        every slot is pinned. Pending slots are pinned until `confirm`."""
        if self._free:
            slot = self._free.pop()
        else:
            victim = next((k for k, s in self._ready.items() if s not in self._pins), None)
            if victim is None:
                return None
            slot = self._ready.pop(victim)
        if pending:
            self._pending[key] = slot
            self.pin(slot)
        else:
            self._ready[key] = slot
        return slot

    def confirm(self, key: bytes, ok: bool) -> None:
        """A pending block's read finished: it is served from now on (ok) or forgotten."""
        slot = self._pending.pop(key, None)
        if slot is None:
            return
        self.pin(slot, unpin=True)
        if ok:
            self._ready[key] = slot
        else:
            self._free.append(slot)

    def pin(self, slot: int, unpin: bool = False) -> None:
        n = self._pins.get(slot, 0) + (-1 if unpin else 1)
        if n < 0:
            raise RuntimeError(f"host slot {slot} unpinned more often than pinned")
        if n:
            self._pins[slot] = n
        else:
            self._pins.pop(slot, None)

    def clear(self) -> None:
        """Forget every ready block (pending and pinned ones stay)."""
        for key, slot in list(self._ready.items()):
            if slot not in self._pins:
                del self._ready[key]
                self._free.append(slot)

    def check_integrity(self) -> None:
        total = len(self._free) + len(self._ready) + len(self._pending)
        if total != self.num_slots:
            raise AssertionError(f"host slots drifted: {total} != {self.num_slots}")
        held = set(self._ready.values()) | set(self._pending.values())
        if not set(self._pins) <= held:
            raise AssertionError("a pinned host slot holds no block")
