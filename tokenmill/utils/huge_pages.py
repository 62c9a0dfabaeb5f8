"""Large CPU tensors backed by transparent huge pages (2 MiB) where the OS offers them.

A decode step streams every weight once (538 MB for SmolLM2 float32) and attention reads KV
blocks scattered over gigabytes. With 4 KiB pages that is one TLB entry per 4 KiB and a page
walk at every page boundary of the stream; with 2 MiB pages the same reads need 512x fewer
entries (benchmarks/weight_stream.py measures the difference). Linux hands out huge pages to
anonymous memory that asks for them with madvise(MADV_HUGEPAGE) when transparent huge pages
are in "madvise" mode (the common default); in "always" mode every large allocation gets them.

`zeros(shape, dtype)` maps fresh anonymous memory (zero-filled by the OS, touched lazily, so a
2 GiB KV cache costs nothing until used and 512x fewer page faults when it is), aligned to
2 MiB and advised. `move_parameters_to_huge_pages(module)` copies a model's CPU parameters into
one such arena and points each parameter at its slice (same Parameter objects, so ties and
references survive). Where madvise or huge pages are unavailable (not Linux, THP "never") the
memory is ordinary pages: only the speed differs, never the values.

Invariant: the returned tensor keeps its mapping alive (torch.frombuffer holds the buffer).
"""

from __future__ import annotations

import logging
import math
import mmap

import torch
from torch import nn

from tokenmill.utils.file_maps import file_map_ranges, is_file_mapped
from tokenmill.utils.heap import trim_heap

logger = logging.getLogger(__name__)

HUGE_PAGE = 2 << 20
_THP_MODE_FILE = "/sys/kernel/mm/transparent_hugepage/enabled"


def thp_mode() -> str:
    """The kernel's transparent-huge-page mode ("always", "madvise", "never"), or "" if the
    system has none (not Linux)."""
    try:
        with open(_THP_MODE_FILE) as f:
            text = f.read()
    except OSError:
        return ""
    start, end = text.find("["), text.find("]")
    return text[start + 1:end] if 0 <= start < end else ""


def zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zero CPU tensor of `shape` in fresh anonymous memory, 2 MiB aligned, advised for huge
    pages. Pages are zeroed by the OS on first touch (no up-front write)."""
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    # Map one huge page more than needed so the tensor can start on a 2 MiB boundary: only
    # aligned 2 MiB ranges of a mapping can be huge pages.
    buf = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is not None and thp_mode() in ("madvise", "always"):
        try:
            buf.madvise(advice)
        except OSError as e:  # a kernel without THP support: plain pages
            logger.debug("madvise(MADV_HUGEPAGE) failed: %s", e)
    raw = torch.frombuffer(buf, dtype=torch.uint8)  # holds `buf` alive
    offset = -raw.data_ptr() % HUGE_PAGE
    return raw[offset:offset + nbytes].view(dtype).view(shape)


def fresh(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A CPU tensor to be written whole once (weights packed at load): `zeros` where it
    spans a huge page or more, else an ordinary allocation. Kept where it is written
    (keep_pages), so each of its pages is touched once."""
    if math.prod(shape) * dtype.itemsize >= HUGE_PAGE:
        return zeros(shape, dtype)
    return torch.empty(shape, dtype=dtype)


def keep_pages(param: nn.Parameter) -> nn.Parameter:
    """Leave `param` where it is in `move_parameters_to_huge_pages`: weights written once into
    fresh memory at load (GGUF blocks packed into tiles, into `fresh` memory: quantization/
    gguf.py), whose copy into the arena would touch every page a second time (a page's first
    touch ran at ~0.25-0.3 GB/s on the development VM: the 1B Q4_K_M file's load 1.0 -> 4.8 s,
    the 1B Q8_0's 13 s; benchmarks/RESULTS.md, forty-seventh and fifty-sixth sessions)."""
    param.keep_pages = True
    return param


def move_parameters_to_huge_pages(module: nn.Module, min_bytes: int = 1 << 20) -> int:
    """Copy every CPU parameter of at least `min_bytes` into one huge-page arena, in module
    order, and point it there, except those that lie in a file's map (GGUF blocks used in
    place from the page cache: utils/file_maps.py) and those marked `keep_pages`. Returns the
    bytes moved. Call it after
    loading and before anything takes references to the parameters' storage (prepacking,
    kernels' views)."""
    mapped = file_map_ranges()
    params = [p for p in module.parameters()  # parameters() yields a tied tensor once
              if p.device.type == "cpu" and p.numel() * p.element_size() >= min_bytes
              and not is_file_mapped(p, mapped) and not getattr(p, "keep_pages", False)]
    if not params:
        return 0
    align = 64  # every parameter starts on a cache line
    offsets, total = [], 0
    for p in params:
        offsets.append(total)
        total += -(-p.numel() * p.element_size() // align) * align
    arena = zeros((total,), torch.uint8)
    freed = 0
    with torch.no_grad():
        for p, off in zip(params, offsets, strict=True):
            nbytes = p.numel() * p.element_size()
            dst = arena[off:off + nbytes].view(p.dtype).view(p.shape)
            dst.copy_(p.data)
            p.data = dst
            freed += nbytes
            if freed >= _TRIM_EVERY:  # hand the freed copies back as we go: the peak stays
                trim_heap()          # near one copy of the weights, not two
                freed = 0
    trim_heap()
    return total


# Parameters below glibc's mmap threshold (32 MiB at most: loads run under glibc's own
# thresholds, utils/heap.py) live on the heap, whose freed pages stay in the process until
# trimmed.
_TRIM_EVERY = 256 << 20
