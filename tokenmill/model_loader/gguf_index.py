"""Where each tensor of a GGUF file is, without parsing its metadata again.

The gguf package's reader parses every metadata field in Python when it opens a file: a
Llama 3 file's 128k-token vocabulary and 280k merges take 8-10 s and about a gigabyte of
small numpy objects, at every start. The tensors need none of it: their names, types, shapes
and offsets (and the architecture, which names them). `GGUFIndex` holds exactly that; the
first start builds it with the reader and writes it beside the converted model
(model_loader/gguf_cache.py); later starts read it back and take the tensor bytes from a plain
memory map of the file. The data views are those the reader gives (`tensor_data`), so
everything downstream is unchanged.

The map is private and copy-on-write (numpy's mode "c"): the block rows the kernels read as
stored are used in place from it (model_loader/gguf_loader.py `iterate_gguf`'s in_place), as
writable tensors without a copy; nothing writes to them, and a write would copy its page for
this process and never reach the file. A view keeps the map open for as long as it lives.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

INDEX_FILE = "tensor_index.json"
_VERSION = 1


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    type_name: str  # GGML type name, "Q4_K", "F16", ...
    dims: tuple[int, ...]  # as the file states them (innermost first)
    n_elements: int
    n_bytes: int
    data_offset: int  # from the file's start


@dataclass(frozen=True)
class GGUFIndex:
    architecture: str
    experts: int
    tensors: tuple[GGUFTensor, ...]


def build_index(reader: Any) -> GGUFIndex:
    """The index of a file the gguf package's reader has opened."""
    arch = reader.fields["general.architecture"].contents()
    experts_field = reader.fields.get(f"{arch}.expert_count")
    tensors = tuple(GGUFTensor(t.name, t.tensor_type.name, tuple(int(d) for d in t.shape),
                               int(t.n_elements), int(t.n_bytes), int(t.data_offset))
                    for t in reader.tensors)
    return GGUFIndex(arch, int(experts_field.contents()) if experts_field else 0, tensors)


def write_index(index: GGUFIndex, folder: str) -> None:
    with open(os.path.join(folder, INDEX_FILE), "w") as f:
        json.dump({"version": _VERSION, **asdict(index)}, f)


def read_index(folder: str) -> GGUFIndex | None:
    """The index written into `folder`, or None (absent, or of another version)."""
    try:
        with open(os.path.join(folder, INDEX_FILE)) as f:
            data = json.load(f)
    except (OSError, ValueError):
        return None
    if data.get("version") != _VERSION:
        return None
    tensors = tuple(GGUFTensor(**{**t, "dims": tuple(t["dims"])}) for t in data["tensors"])
    return GGUFIndex(data["architecture"], data["experts"], tensors)


def file_map(path: str) -> np.memmap:
    """The whole file, memory-mapped copy-on-write (module doc). Each call maps it afresh: a
    load reads through one map, and the tensors it uses in place keep that one alive."""
    return np.memmap(path, mode="c")


def tensor_data(path: str, t: GGUFTensor, data: np.memmap | None = None) -> np.ndarray:
    """The tensor as the gguf package's reader gives it: F32 / F16 as typed arrays of the
    tensor's shape, every other type as uint8 block rows (rows..., bytes per row); a view of
    `data` (the file's map, file_map(path), mapped here when not given)."""
    import gguf

    data = file_map(path) if data is None else data
    raw = data[t.data_offset:t.data_offset + t.n_bytes]
    shape = tuple(reversed(t.dims))
    if t.type_name == "F32":
        return raw.view(np.float32).reshape(shape)
    if t.type_name == "F16":
        return raw.view(np.float16).reshape(shape)
    qtype = gguf.GGMLQuantizationType[t.type_name]
    return raw.reshape(gguf.quants.quant_shape_to_byte_shape(shape, qtype))
