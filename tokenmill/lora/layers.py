"""LoRA on one linear layer: the adapter slots a step may use, and their grouped products.

A LoRA-capable linear layer (layers/linear.py `LinearBase.lora`) holds `max_loras` slots. Slot
s holds one adapter's A for every part of the layer, stacked (the merged qkv_proj has three
parts: q, k, v; gate_up_proj two; the others one), each part's B and the adapter's scaling,
sharded as the layer is. A step's rows come grouped by slot
(`LoRAStep`, set by the runner before the forward pass, shared by every layer), and each group
costs two products whatever its size (Punica's shrink / expand, gathered per adapter, never one
product per request):

    h = (x[rows] @ A_s^T) * scaling_s        (n, P r)    shrink, all parts at once
    y[rows, part p] += h[:, p r:(p+1) r] @ B_sp^T        expand, per part (B_sp^T held)

B^T is held in column blocks of COLUMN_BLOCK (per block its (r, width) values contiguous, the
last block narrower): the C++ expand then streams a slot in address order, which a decode
step's one row makes bound by memory; held as (r, out) rows it read each block as r runs far
apart and reached half the memory's rate. The torch ops read the same blocks (`expand`).

Row-parallel layers add the delta to their partial sum before the all-reduce: A is split along
the input as the weight is, and the sum of the ranks' x_i A_i^T is x A^T. Column-parallel
layers hold A whole and their share of B's rows. A and B hold the adapter file's values (in
the slots' dtype: exact when it is the file's; B^T in its blocks), the scaling (alpha / r)
beside them and applied to h.

On CPU in float32 one C++ call per layer does every slot of the step (csrc/lora_cpu.h, with
the batch-invariant dot kernels of linear_dot.h: the per-adapter Python loop of small ops cost
more than the products); elsewhere (CUDA, other dtypes) the same products run as torch ops,
one gathered pair per adapter.

Invariants: a row's delta depends on that row and its adapter only; a slot of rank 0 adds
nothing, nor does a part its adapter leaves alone; an adapter's rank r < max_rank uses the
first r rows of its slot, so a small adapter costs its own rank, not the maximum.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from tokenmill.layers import cpu_ops

# B^T's column blocks (csrc/lora_cpu.h kCols): a multiple of every CPU build's vector width.
COLUMN_BLOCK = 64


def blocked_columns(bt: torch.Tensor) -> torch.Tensor:
    """bt (r, n) as its flat column blocks (r * n,): full blocks of COLUMN_BLOCK columns, then
    the rest, each block's rows contiguous."""
    r, n = bt.shape
    full = n - n % COLUMN_BLOCK
    head = bt[:, :full].reshape(r, full // COLUMN_BLOCK, COLUMN_BLOCK).transpose(0, 1)
    return torch.cat([head.reshape(-1), bt[:, full:].reshape(-1)])


def expand(h: torch.Tensor, blocks: torch.Tensor, n: int) -> torch.Tensor:
    """h (m, r) @ B^T (r, n) for B^T held as `blocked_columns` → (m, n)."""
    m, r = h.shape
    full = n - n % COLUMN_BLOCK
    head = torch.einsum("mr,brc->mbc", h,
                        blocks[:full * r].view(full // COLUMN_BLOCK, r, COLUMN_BLOCK))
    tail = h @ blocks[full * r:].view(r, n - full)
    return torch.cat([head.reshape(m, full), tail], dim=1)


@dataclass
class LoRAStep:
    """The step's rows by adapter slot: (slot, rows) with rows a slice (one request, or
    consecutive ones) or an index tensor, and row_slot (T,) int64, each row's slot or -1.
    Empty groups: no row uses an adapter."""

    groups: list[tuple[int, slice | torch.Tensor]] = field(default_factory=list)
    row_slot: torch.Tensor | None = None


class LinearLoRA:
    def __init__(self, in_features: int, part_sizes: list[int], max_loras: int, max_rank: int,
                 step: LoRAStep, dtype: torch.dtype, device: torch.device) -> None:
        """part_sizes: each part's output features on this rank, in the layer's order."""
        self.in_features, self.part_sizes = in_features, part_sizes
        self.offsets = [sum(part_sizes[:i]) for i in range(len(part_sizes))]
        self.step = step
        P = len(part_sizes)
        # flat per slot, so that rank r's leading rows are contiguous
        self.a = torch.zeros(max_loras, P * max_rank * in_features, dtype=dtype, device=device)
        # B transposed, (rank, out) per slot in column blocks: the expand runs along the
        # outputs, reading the slot in address order
        self.b = [torch.zeros(max_loras, max_rank * n, dtype=dtype, device=device)
                  for n in part_sizes]
        # each slot's rank (0: empty) and the parts its adapter changes, as the C++ call
        # reads them
        self.ranks = torch.zeros(max_loras, dtype=torch.int64)
        self.scales = torch.zeros(max_loras, dtype=torch.float32)
        self.present = torch.zeros(max_loras, P, dtype=torch.uint8)

    def set_slot(self, slot: int, rank: int, scaling: float,
                 parts: list[tuple[torch.Tensor, torch.Tensor] | None]) -> None:
        """Load slot `slot`: the adapter's scaling and, per part, (A (rank, in), B (out,
        rank)) as this rank holds them, or None where the adapter leaves the part alone."""
        P, K = len(self.part_sizes), self.in_features
        if not any(p is not None for p in parts):
            self.clear_slot(slot)
            return
        a = self.a[slot, :P * rank * K].view(P * rank, K)
        a.zero_()
        for p, pair in enumerate(parts):
            bt = self.b[p][slot, :rank * self.part_sizes[p]]
            if pair is None:
                bt.zero_()
                continue
            a[p * rank:(p + 1) * rank].copy_(pair[0])
            bt.copy_(blocked_columns(pair[1].t()))
        self.ranks[slot] = rank
        self.scales[slot] = scaling
        self.present[slot] = torch.tensor([p is not None for p in parts], dtype=torch.uint8)

    def clear_slot(self, slot: int) -> None:
        self.ranks[slot] = 0
        self.present[slot] = 0

    def add(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """y (T, out) += each row's adapter delta, for x (T, in) the layer's input."""
        step = self.step
        if not step.groups:
            return y
        if cpu_ops.fused(x) and y.is_contiguous():
            cpu_ops.lora_add_(x.contiguous(), y, self.a, self.b, self.ranks, self.scales,
                              self.present, step.row_slot)
            return y
        for slot, rows in step.groups:
            self._add_slot(x, y, slot, rows)
        return y

    def _add_slot(self, x: torch.Tensor, y: torch.Tensor, slot: int,
                  rows: slice | torch.Tensor) -> None:
        """One adapter's rows as torch ops (CUDA, other dtypes): its shrink, then each part's
        expand added into the part's columns."""
        r = int(self.ranks[slot])
        if r == 0:
            return
        P, K = len(self.part_sizes), self.in_features
        xs = x[rows] if isinstance(rows, slice) else x.index_select(0, rows)
        h = F.linear(xs, self.a[slot, :P * r * K].view(P * r, K).to(x.dtype))  # (n, P r)
        h = h * self.scales[slot].to(h.dtype)
        for p, size in enumerate(self.part_sizes):
            if not self.present[slot, p]:
                continue
            o = self.offsets[p]
            part = expand(h[:, p * r:(p + 1) * r], self.b[p][slot, :r * size].to(x.dtype), size)
            if isinstance(rows, slice):
                y[rows, o:o + size] += part
            else:
                y[:, o:o + size].index_add_(0, rows, part)
