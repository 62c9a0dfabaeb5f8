"""SwapSpace: the CPU-side block ids holding the KV of swapped-out requests.

Pure bookkeeping (the model runner owns the CPU tensor and does the copies). Invariant:
free + held == num_blocks, and a request holds either GPU blocks or swap blocks, never both.
"""

from __future__ import annotations


class SwapSpace:
    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))  # pop() hands out 0, 1, 2, ...
        self.req_to_blocks: dict[str, list[int]] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def allocate(self, request_id: str, n: int) -> list[int] | None:
        if n > len(self._free) or request_id in self.req_to_blocks:
            return None
        blocks = [self._free.pop() for _ in range(n)]
        self.req_to_blocks[request_id] = blocks
        return blocks

    def free(self, request_id: str) -> None:
        self._free.extend(reversed(self.req_to_blocks.pop(request_id, [])))

    def check_integrity(self) -> None:
        held = sum(len(b) for b in self.req_to_blocks.values())
        if held + len(self._free) != self.num_blocks:
            raise AssertionError(f"swap accounting broken: {held} held + {len(self._free)} "
                                 f"free != {self.num_blocks}")
