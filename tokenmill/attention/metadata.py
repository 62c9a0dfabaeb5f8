"""AttentionMetadata: what every backend's per-step metadata has. Each backend subclasses it
with what its own forward reads (torch_ref.py: decode groups and prefill sequences;
cpu_paged.py: the kernel's queries; triton_paged.py: query tiles) and builds it
in `build_metadata`; code outside a backend reads only these fields, and asks the backend
(AttentionBackend's hooks) for anything else.

The step's tokens are one flat batch of T tokens (no padding) from B sequences.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    num_tokens: int
    slot_mapping: torch.Tensor  # (T,) long: the cache slot each new token's K/V is written to
