"""AttentionBackend: the interface every attention implementation provides, and a lazy registry.

Contract:
- `build_metadata(batch)` runs once per step, before the forward pass, and may build tensors.
- `forward(q, k, v, kv_cache, meta)` first writes this step's k/v into `kv_cache` at
  `meta.slot_mapping`, then returns attention of every query over its sequence's cached
  context (causal), shape (T, num_heads * head_dim). It runs once per layer and must not
  rebuild what `build_metadata` could have built.
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

import torch

from tokenmill.attention.metadata import AttentionMetadata

if TYPE_CHECKING:
    from tokenmill.worker.input_batch import InputBatch


class AttentionBackend(ABC):
    def __init__(self, block_size: int, device: torch.device) -> None:
        self.block_size = block_size
        self.device = device

    @abstractmethod
    def build_metadata(self, batch: InputBatch) -> AttentionMetadata: ...

    @abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """q (T, Hq, D); k, v (T, Hkv, D); kv_cache (2, num_blocks, block_size, Hkv, D)."""


_REGISTRY = {"torch": ("tokenmill.attention.torch_ref", "TorchPagedAttention"),
             "cpu": ("tokenmill.attention.cpu_paged", "CPUPagedAttention"),
             "triton": ("tokenmill.attention.triton_paged", "TritonPagedAttention")}
BACKEND_NAMES = ("auto", *_REGISTRY)


def get_attention_backend(name: str, block_size: int, device: torch.device,
                          dtype: torch.dtype = torch.float32) -> AttentionBackend:
    """`auto`: the C++ kernel backend for float32 on CPU when it builds, the Triton kernel on
    CUDA when triton is installed, else PyTorch."""
    if name == "auto":
        name = "torch"
        if device.type == "cpu" and dtype == torch.float32:
            from tokenmill.attention.cpu_kernels import paged_attention_op

            name = "cpu" if paged_attention_op() is not None else "torch"
        elif device.type == "cuda":
            from tokenmill.attention.triton_paged import triton_available

            name = "triton" if triton_available() else "torch"
    if name not in _REGISTRY:
        raise ValueError(f"unknown attention backend {name!r}; known: "
                         f"{', '.join(BACKEND_NAMES)}")
    module, cls = _REGISTRY[name]
    return getattr(importlib.import_module(module), cls)(block_size, device)
