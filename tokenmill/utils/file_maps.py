"""Which CPU tensors lie in a file's memory map: a GGUF file's blocks used in place
(model_loader/gguf_loader.py `iterate_gguf`) are the page cache's pages, mapped into this
process. They stay where they are (utils/huge_pages.py does not copy them into huge pages), and
the automatic KV budget counts them as taken (worker/kv_budget.py): the kernel reports page
cache as available memory, but evicting these pages would make every step read the file again.

Read from /proc/self/maps (Linux); where there is none, no tensor is file-backed.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable

import torch


def file_map_ranges() -> list[tuple[int, int]]:
    """This process's mappings of files, [start, end) addresses, sorted."""
    ranges = []
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                fields = line.split(maxsplit=5)  # range perms offset dev inode [path]
                if len(fields) == 6 and fields[4] != "0" and fields[5].startswith("/"):
                    start, end = fields[0].split("-")
                    ranges.append((int(start, 16), int(end, 16)))
    except OSError:
        return []
    return sorted(ranges)


def is_file_mapped(tensor: torch.Tensor, ranges: list[tuple[int, int]]) -> bool:
    """Whether a CPU tensor's bytes lie in one of `ranges` (file_map_ranges())."""
    if tensor.device.type != "cpu" or tensor.numel() == 0:
        return False
    start = tensor.data_ptr()
    i = bisect.bisect_right(ranges, (start, float("inf"))) - 1
    return i >= 0 and start + tensor.numel() * tensor.element_size() <= ranges[i][1]


def file_mapped_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """The bytes of `tensors` that are file-backed (each tensor counted once)."""
    ranges = file_map_ranges()
    return sum(t.numel() * t.element_size() for t in tensors if is_file_mapped(t, ranges))
