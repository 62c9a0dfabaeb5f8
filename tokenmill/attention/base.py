"""AttentionBackend: the interface every attention implementation provides (the backends
are registered in registry.py).

Contract:
- `build_metadata(batch)` runs once per step, before the forward pass, and may build tensors;
  it returns the backend's own AttentionMetadata subclass, which only the backend reads.
- `forward(layer, q, k, v, kv_cache, meta)` first writes this step's k/v into
  `kv_cache` at `meta.slot_mapping` (quantized in the same op when the cache is int8 or fp8,
  attention/kv_cache.py; the layer's AttentionVariant and fp8 kv_scales), then returns attention of
  every query over its sequence's cached context (causal), shape (T, num_heads * head_dim).
  It runs once per layer and must not rebuild what `build_metadata` could have built.
- Attention variants (`FEATURES`): a layer may ask for a sliding window ("sliding_window": a
  query at position p attends keys at positions > p - window) and soft-capped scores
  ("soft_cap": cap * tanh(score / cap), Gemma 2). A backend lists the variants it computes in
  `FEATURES` (an allow-list); `get_attention_backend` (registry.py) gives a model only a
  backend that lists every variant its layers use, and is told them at construction
  (`features`: e.g. a windowed model plans no cascades, whose shared prefix could lie outside a
  window).
- Hooks for code outside the backends, instead of reading its metadata: `fused_decode_queries`
  (can this step go through the fused CPU layers call, and with which queries) and
  `decode_graph_state` (static buffers and padding for decode steps replayed as CUDA graphs).
  Both default to "not supported": a backend opts in by implementing them.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Hashable
from typing import Any, NamedTuple, Protocol

import torch

from tokenmill.attention.input_batch import InputBatch
from tokenmill.attention.metadata import AttentionMetadata


class AttentionVariant(NamedTuple):
    """What one layer's attention computes, fixed when the layer is built: softmax(q k^T *
    scale) v over the causal context, with optionally a sliding window (a query at position
    p attends keys at positions > p - window) and soft-capped scores (cap * tanh(s / cap)).
    A new variant is a new field here and in the backends' FEATURES, not a new argument."""

    scale: float
    sliding_window: int | None = None
    soft_cap: float | None = None


class AttentionLayer(Protocol):
    """What a backend reads of the layer it attends for (layers/attention.py Attention)."""

    variant: AttentionVariant
    kv_scales: torch.Tensor | None  # (2, Hkv): an fp8 cache's fixed scales


class DecodeGraphState(ABC):
    """A backend's attention inputs for decode steps of up to `max_seqs` sequences captured as
    CUDA graphs, in static buffers. Rows past a step's n sequences are padding at position 0
    that attends only the null block (block 0, never handed out)."""

    def variants(self, size: int) -> tuple[Hashable, ...]:
        """The layouts a graph of `size` rows is captured in (one graph each); one by default.
        A variant must compute what the others compute for every step it is chosen for."""
        return (None,)

    def variant(self, batch: InputBatch, size: int) -> Hashable:
        """Which of `variants(size)` replays this step (called after `load` accepted it)."""
        return None

    @abstractmethod
    def metadata(self, size: int, positions: torch.Tensor, variant: Hashable = None
                 ) -> AttentionMetadata:
        """Metadata for a graph of `size` rows at static `positions` (max_seqs,) in `variant`:
        what it derives from them and the buffers is computed by device ops, captured in the
        graph."""

    @abstractmethod
    def load(self, batch: InputBatch, size: int) -> bool:
        """Copy a step's attention inputs into the buffers, rows n..size padded; False (nothing
        copied) when the step cannot replay a graph (not a plain decode step, too wide)."""


class AttentionBackend(ABC):
    FEATURES: frozenset[str] = frozenset()  # the attention variants this backend computes

    def __init__(self, block_size: int, device: torch.device,
                 features: frozenset[str] = frozenset(), max_model_len: int | None = None
                 ) -> None:
        """features: the variants the model's layers use (a subset of FEATURES);
        max_model_len: the longest context a query sees (None: unknown), which a backend may
        size its work by (the Triton backend's split-KV decode)."""
        self.block_size = block_size
        self.device = device
        self.features = features
        self.max_model_len = max_model_len

    @abstractmethod
    def build_metadata(self, batch: InputBatch) -> AttentionMetadata: ...

    @abstractmethod
    def forward(self, layer: AttentionLayer, q: torch.Tensor, k: torch.Tensor,
                v: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata
                ) -> torch.Tensor:
        """q (T, Hq, D); k, v (T, Hkv, D); kv_cache (2, num_blocks, block_size, Hkv, R) in
        any format of kv_cache.py, read in place; the layer's variant (scale, window, soft
        cap, as `features` said) and its fp8 cache's kv_scales come from `layer`."""

    def fuses_rotary(self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                     sin: torch.Tensor) -> bool:
        """Whether `forward_rotary` takes these operands: the layer's RoPE tables cos / sin
        (T, 1, R) applied to q and k inside the step's store (one launch fewer a layer).
        Default: never (the layer rotates q and k itself, then calls forward)."""
        return False

    def forward_rotary(self, layer: AttentionLayer, q: torch.Tensor, k: torch.Tensor,
                       v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                       kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """forward() of q and k rotated by cos / sin (rotate_half over their first R
        features, rounded as layers/rotary.py rounds), only where fuses_rotary said so."""
        raise NotImplementedError(f"{type(self).__name__} does not fuse RoPE into its store")

    def fused_decode_queries(self, meta: AttentionMetadata, num_tokens: int) -> Any | None:
        """When every one of the step's `num_tokens` queries can go to the CPU paged-attention
        kernel (csrc/paged_attention_cpu.h) from inside the fused CPU layers call
        (models/cpu_decode.py), which runs that kernel itself: the kernel's queries; else
        None. Default: never (a backend without that kernel keeps its own forward)."""
        return None

    def decode_graph_state(self, max_seqs: int, max_blocks: int) -> DecodeGraphState | None:
        """Static buffers for CUDA-graph decode steps (worker/cuda_graphs.py); None: this
        backend's decode steps run eagerly."""
        return None
