"""LoRAManager: the runner's adapters (vLLM's LRUCacheWorkerLoRAManager on our layers).

It gives every targeted linear layer of the model a `LinearLoRA` (lora/layers.py) and keeps
two bounded sets of adapters, each least recently used first out:
- in memory, read from their folders (`max_cpu_loras`): loading one is a file read;
- in slots (`max_loras`): what a step can use, copied into every layer's slot buffers.

Each step, `begin_step(reqs)` slots the step's adapters (the scheduler never schedules more
than max_loras of them) and groups the batch's rows by slot; `end_step()` empties the groups,
so that nothing else run on the model (a draft model's pass on the same layers, a warm-up)
sees the step's adapters. The draft model of speculative decoding ignores adapters: its drafts
are verified by the target model with the request's adapter, so only acceptance depends on it.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING

import torch
from torch import nn

from tokenmill.attention.input_batch import to_device
from tokenmill.layers.linear import LinearBase, QKVParallelLinear, RowParallelLinear
from tokenmill.lora.layers import LinearLoRA, LoRAStep
from tokenmill.lora.peft_files import PeftAdapter, read_adapter

if TYPE_CHECKING:
    from tokenmill.config import LoRAConfig
    from tokenmill.core.interface import ScheduledRequest
    from tokenmill.lora.request import AdapterRef


def _parts(name: str, packed: dict[str, tuple[str, int | str]]) -> list[str]:
    """The checkpoint modules a layer of ours stands for, in its shard order."""
    leaf = name.rsplit(".", 1)[-1]
    merged = [(shard, ckpt) for ckpt, (ours, shard) in packed.items() if ours == leaf]
    if not merged:
        return [leaf]
    order = {"q": 0, "k": 1, "v": 2}
    return [ckpt for _, ckpt in sorted(merged, key=lambda m: order.get(m[0], m[0]))]


class LoRAManager:
    TARGET_LEAVES = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")

    def __init__(self, model: nn.Module, config: LoRAConfig, device: torch.device) -> None:
        self.config, self.device = config, device
        dtype = getattr(torch, config.lora_dtype)  # resolved: never "auto" here
        self.step = LoRAStep()
        # each targeted layer, its slots and the checkpoint modules of its parts, in order
        self.layers: list[tuple[LinearBase, LinearLoRA, list[str]]] = []
        packed = getattr(model, "packed_modules_mapping", {})
        for name, module in model.named_modules():
            if not (isinstance(module, LinearBase)
                    and name.rsplit(".", 1)[-1] in self.TARGET_LEAVES):
                continue
            parts = _parts(name, packed)
            lora = LinearLoRA(module.input_size, self._part_sizes(module, len(parts)),
                              config.max_loras, config.max_lora_rank, self.step, dtype, device)
            module.lora = lora
            prefix = name.rsplit(".", 1)[0]
            names = [f"{prefix}.{p}" for p in parts]
            self.layers.append((module, lora, names))
        self.slots: list[str | None] = [None] * config.max_loras  # adapter key per slot
        self._slot_use: OrderedDict[int, None] = OrderedDict((i, None)
                                                             for i in range(config.max_loras))
        self.in_memory: OrderedDict[str, PeftAdapter] = OrderedDict()

    @staticmethod
    def _part_sizes(layer: LinearBase, num_parts: int) -> list[int]:
        if isinstance(layer, QKVParallelLinear):
            q, kv = layer.num_heads * layer.head_dim, layer.num_kv_heads * layer.head_dim
            return [q, kv, kv]
        if num_parts > 1:
            tp = layer.tp.tp_size
            return [size // tp for size in layer.output_sizes]
        return [layer.output_size]

    # ---- adapters in memory and in slots ----------------------------------------------------
    def _adapter(self, ref: AdapterRef) -> PeftAdapter:
        adapter = self.in_memory.pop(ref.key, None)
        if adapter is None:
            adapter = read_adapter(ref.path)
            if adapter.key != ref.key:  # the folder changed since the front-end checked it
                raise RuntimeError(f"LoRA adapter {ref.name!r} at {ref.path!r} changed on disk "
                                   "after it was loaded; load it again under a new name")
        self.in_memory[ref.key] = adapter
        while len(self.in_memory) > self.config.max_cpu_loras:
            self.in_memory.popitem(last=False)
        return adapter

    def _slot(self, ref: AdapterRef, pinned: set[int]) -> int:
        """A slot holding the adapter: its own, else the least recently used one not pinned
        by this step, loaded."""
        if ref.key in self.slots:
            slot = self.slots.index(ref.key)
        else:
            slot = next((s for s in self._slot_use if s not in pinned), None)
            if slot is None:
                raise RuntimeError(f"a step uses more than max_loras="
                                   f"{self.config.max_loras} adapters")
            self._load(slot, self._adapter(ref))
        self._slot_use.move_to_end(slot)
        return slot

    def _load(self, slot: int, adapter: PeftAdapter) -> None:
        for layer, lora, names in self.layers:
            parts = []
            for p, name in enumerate(names):
                pair = adapter.weights.get(name)
                parts.append(None if pair is None else self._shard(layer, p, *pair))
            lora.set_slot(slot, adapter.config.r, adapter.config.scaling, parts)
        self.slots[slot] = adapter.key

    @staticmethod
    def _shard(layer: LinearBase, part: int, a: torch.Tensor, b: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's A and B of one part: a row-parallel layer's input columns of A, a
        column-parallel layer's output rows of B (a replicated KV head's by its index)."""
        tp, rank = layer.tp.tp_size, layer.tp.tp_rank
        if tp == 1:
            return a, b
        if isinstance(layer, RowParallelLinear):
            n = layer.input_size
            return a.narrow(1, rank * n, n), b
        size = b.shape[0] // tp
        if isinstance(layer, QKVParallelLinear) and part > 0:
            size = layer.num_kv_heads * layer.head_dim
            rank //= layer.kv_replicas
        return a, b.narrow(0, rank * size, size)

    # ---- steps ------------------------------------------------------------------------------
    def begin_step(self, reqs: list[ScheduledRequest]) -> None:
        """Slot the step's adapters and group its rows (in the batch's order) by slot."""
        rows: dict[int, list[tuple[int, int]]] = {}
        pinned: set[int] = set()
        row_slot: list[int] = []
        start = 0
        for r in reqs:
            slot = -1
            if r.lora is not None:
                slot = self._slot(r.lora, pinned)
                pinned.add(slot)
                spans = rows.setdefault(slot, [])
                if spans and spans[-1][1] == start:  # consecutive requests: one span
                    spans[-1] = (spans[-1][0], start + r.num_tokens)
                else:
                    spans.append((start, start + r.num_tokens))
            row_slot += [slot] * r.num_tokens
            start += r.num_tokens
        self.step.groups = [(slot, self._rows(spans)) for slot, spans in rows.items()]
        self.step.row_slot = torch.tensor(row_slot, dtype=torch.int64)

    def _rows(self, spans: list[tuple[int, int]]) -> slice | torch.Tensor:
        if len(spans) == 1:
            return slice(*spans[0])
        return to_device([torch.cat([torch.arange(s, e) for s, e in spans])], self.device)[0]

    def end_step(self) -> None:
        self.step.groups, self.step.row_slot = [], None
