"""Which CPU tensors lie in a file's memory map, and advice on their pages. Weights used in
place (a GGUF file's blocks, model_loader/gguf_loader.py `iterate_gguf`; a safetensors file's
half-precision tensors, model_loader/safetensors_loader.py) are the page cache's pages, mapped
into this process. They stay where they are (utils/huge_pages.py does not copy them into huge
pages), and the automatic KV budget counts them as taken (worker/kv_budget.py): the kernel
reports page cache as available memory, but evicting these pages would make every step read the
file again.

Read from /proc/self/maps (Linux); where there is none, no tensor is file-backed, and advice is
never given (`advise_file_pages` changes memory and speed, never contents: it acts only on
file-backed bytes, whose pages come back from the file as they were).
"""

from __future__ import annotations

import bisect
import ctypes
import ctypes.util
import functools
import mmap
from collections.abc import Iterable

import torch

# Linux's MADV_POPULATE_READ (5.14; Python 3.11's mmap module does not name it)
MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)
MADV_WILLNEED = getattr(mmap, "MADV_WILLNEED", None)
MADV_DONTNEED = getattr(mmap, "MADV_DONTNEED", None)


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


@functools.cache
def _madvise() -> ctypes._CFuncPtr | None:
    if MADV_DONTNEED is None:  # no madvise on this system (Windows)
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:
        return None
    fn = libc.madvise
    fn.argtypes, fn.restype = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int), ctypes.c_int
    return fn


def advise_file_pages(start: int, nbytes: int, *advice: int | None,
                      ranges: list[tuple[int, int]] | None = None) -> bool:
    """madvise the pages of bytes [start, start + nbytes) with the first of `advice` the kernel
    accepts (None: one this system lacks), only where they lie in a file's map (`ranges`:
    file_map_ranges(), read here when not given): dropping (MADV_DONTNEED) anonymous memory
    would zero it, while a file's pages come back as the file holds them (our maps are private
    and never written). Whether some advice was taken."""
    fn = _madvise()
    ranges = file_map_ranges() if ranges is None else ranges
    i = bisect.bisect_right(ranges, (start, float("inf"))) - 1
    if fn is None or nbytes <= 0 or i < 0 or start + nbytes > ranges[i][1]:
        return False
    first = start // mmap.PAGESIZE * mmap.PAGESIZE  # madvise takes whole pages
    for option in advice:
        if option is not None and fn(first, start + nbytes - first, option) == 0:
            return True
    return False


def advise_tensor_pages(tensor: torch.Tensor, *advice: int | None,
                        ranges: list[tuple[int, int]] | None = None) -> bool:
    """advise_file_pages over a CPU tensor's bytes."""
    if tensor.device.type != "cpu":
        return False
    return advise_file_pages(tensor.data_ptr(), tensor.numel() * tensor.element_size(),
                             *advice, ranges=ranges)
