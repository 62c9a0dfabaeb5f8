"""Streaming (name, tensor) iterator over a Hugging Face folder's *.safetensors files."""

from __future__ import annotations

import glob
import os
from collections.abc import Iterator

import torch
from safetensors import SafetensorError, safe_open


def iterate_safetensors(folder: str) -> Iterator[tuple[str, torch.Tensor]]:
    files = sorted(glob.glob(os.path.join(folder, "*.safetensors")))
    if not files:
        raise ValueError(f"no *.safetensors weight files in {folder}")
    for path in files:
        try:
            with safe_open(path, framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                    yield name, f.get_tensor(name)
        except (OSError, RuntimeError, SafetensorError) as e:
            raise ValueError(f"cannot read weights from {path}: {e}") from e
