"""Streaming (name, tensor) iterator over a Hugging Face folder's *.safetensors files.

The safetensors library maps each file private / copy-on-write and hands out its tensors as
views of that map (0.4 on). A tensor the model keeps as loaded (in_place(name): its parameter
holds its parts, layers/linear.py; half-precision weights the CPU kernels read as stored,
quantization/unquantized.py) is used in place: no copy, its pages the page cache's, populated
once the file is read (as the GGUF loader and llama.cpp's MAP_POPULATE do), and the map lives
exactly as long as those tensors. Every other tensor is copied by the loader, and its pages of
the map are released once the next tensor is asked for (they would count in this process's RSS
beside the copy until the last kept tensor of the file goes). Where the library gives a tensor
in anonymous memory instead, nothing is advised (utils/file_maps.py) and it is kept as given.
"""

from __future__ import annotations

import glob
import os
from collections.abc import Callable, Iterator

import torch
from safetensors import SafetensorError, safe_open

from tokenmill.utils.file_maps import (
    MADV_DONTNEED,
    MADV_POPULATE_READ,
    MADV_WILLNEED,
    advise_tensor_pages,
    file_map_ranges,
)


def iterate_safetensors(folder: str, in_place: Callable[[str], bool] | None = None
                        ) -> Iterator[tuple[str, torch.Tensor]]:
    files = sorted(glob.glob(os.path.join(folder, "*.safetensors")))
    if not files:
        raise ValueError(f"no *.safetensors weight files in {folder}")
    for path in files:
        try:
            yield from _iterate_file(path, in_place)
        except (OSError, RuntimeError, SafetensorError) as e:
            raise ValueError(f"cannot read weights from {path}: {e}") from e


def _iterate_file(path: str, in_place: Callable[[str], bool] | None
                  ) -> Iterator[tuple[str, torch.Tensor]]:
    kept: list[torch.Tensor] = []
    ranges: list[tuple[int, int]] = []  # the file's map among them, once it exists
    with safe_open(path, framework="pt") as f:
        for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
            tensor = f.get_tensor(name)
            ranges = ranges or file_map_ranges()  # read once, after the first tensor
            yield name, tensor
            if in_place is not None and in_place(name):
                kept.append(tensor)
            else:  # copied into the model by now
                advise_tensor_pages(tensor, MADV_DONTNEED, ranges=ranges)
    for tensor in kept:  # the first step would otherwise fault them in page by page
        advise_tensor_pages(tensor, MADV_POPULATE_READ, MADV_WILLNEED, ranges=ranges)
