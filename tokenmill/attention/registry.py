"""The attention backends by name (vLLM's --attention-backend), imported when first asked for.

"auto" picks among them by device and dtype, and only a backend whose FEATURES list every
attention variant a model's layers use (base.py).
"""

from __future__ import annotations

import importlib

import torch

from tokenmill.attention.base import AttentionBackend

_REGISTRY = {"torch": ("tokenmill.attention.torch_ref", "TorchPagedAttention"),
             "cpu": ("tokenmill.attention.cpu_paged", "CPUPagedAttention"),
             "triton": ("tokenmill.attention.triton_paged", "TritonPagedAttention")}
BACKEND_NAMES = ("auto", *_REGISTRY)


def get_attention_backend(name: str, block_size: int, device: torch.device,
                          dtype: torch.dtype = torch.float32,
                          features: frozenset[str] = frozenset(),
                          max_model_len: int | None = None) -> AttentionBackend:
    """`auto`: the C++ kernel backend for float32 on CPU when it builds, the Triton kernel on
    CUDA when triton is installed, else PyTorch; in each case only if it computes every
    attention variant in `features` (else PyTorch, which computes them all). Every backend
    reads every KV cache format (attention/kv_cache.py)."""
    if name not in _REGISTRY and name != "auto":
        raise ValueError(f"unknown attention backend {name!r}; known: "
                         f"{', '.join(BACKEND_NAMES)}")
    if name == "auto":
        name = "torch"
        if device.type == "cpu" and dtype == torch.float32:
            from tokenmill.attention.cpu_kernels import paged_attention_op

            name = "cpu" if paged_attention_op() is not None else "torch"
        elif device.type == "cuda":
            from tokenmill.attention.triton_paged import triton_available

            name = "triton" if triton_available() else "torch"
        if not features <= _backend_class(name).FEATURES:
            name = "torch"
    cls = _backend_class(name)
    if name == "cpu" and (device.type != "cpu" or dtype != torch.float32):
        raise ValueError(f"attention backend 'cpu' (the C++ kernel) computes float32 on CPU, "
                         f"not {dtype} on {device.type}; use attention_backend='torch' or "
                         "'auto'")
    if missing := features - cls.FEATURES:
        raise ValueError(f"attention backend {name!r} does not compute "
                         f"{', '.join(sorted(missing))}, which this model's layers use; "
                         f"use attention_backend='torch' or 'auto'")
    return cls(block_size, device, features, max_model_len)


def _backend_class(name: str) -> type[AttentionBackend]:
    module, cls = _REGISTRY[name]
    return getattr(importlib.import_module(module), cls)
