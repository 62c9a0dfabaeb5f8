"""A GGUF file's expert weights served in their own blocks (`quantization="gguf"`), as its
dense layers are (quantization/gguf.py): llama.cpp stores each MoE layer's experts stacked,
ffn_gate_exps / ffn_up_exps (E, I, H) and ffn_down_exps (E, H, I), each in one GGML type
(Q4_K_M files: gate / up in Q4_K, down in Q4_K or Q6_K). Expanded to float32 they were 4-7x
the file (a 7B MoE file of 4 GB became 28 GB); here each expert's matrices stay the file's
bytes and every product runs the block kernels of its type (csrc/linear_gguf*.h), so an
expert's output is what the same matrix computes as a dense layer, bitwise.

The FusedMoE layer's `w13` (E, 2I, row bytes) and `w2` (E, H, row bytes) are uint8 raw block
rows here: the loader hands each expert's raw rows over (gguf_loader.iterate_gguf, one tensor
per expert, `<...>.experts.<e>.<matrix>.qweight`); gate and up of different types are kept
side by side, each padded to the wider row and cut back after loading, and multiplied as one
merged kernel (CPULinearKernel.PARTS). Under tensor parallelism each rank keeps its share of
every expert as FusedMoE splits float experts: w1 / w3 by rows (whole rows of blocks), w2 by
columns (whole blocks of each row: the share must be whole blocks of w2's type). Invariant: an
expert's kernels read exactly the bytes of its rows (its rank's columns) in the file.
"""

from __future__ import annotations

import functools
import re

import torch
from torch import nn

from tokenmill.layers.expert_weights import EXPERT_MATRICES
from tokenmill.quantization.base import CPULinearKernel, merged_kernel, replace_param
from tokenmill.quantization.gguf import GGUF_TYPES, kernel_tensors


def expert_types(tensor_types: dict[str, str], prefix: str) -> dict[str, str]:
    """The GGML type of each expert matrix (w1, w3, w2) of the MoE layer at `prefix`
    (`model.layers.<i>.<block>.experts`), from the file's HF-named tensor types (stacked
    experts are named with `{e}`)."""
    layer = re.match(r"(.*\.layers\.\d+)\.", prefix)
    if layer is None:
        return {}
    pattern = re.compile(rf"{re.escape(layer[1])}\.\w+\.experts\.\{{e\}}\.(\w+)\.weight$")
    found = {}
    for name, type_name in tensor_types.items():
        if (m := pattern.match(name)) and m[1] in EXPERT_MATRICES:
            found[EXPERT_MATRICES[m[1]]] = type_name
    return found


class GGUFExpertsMethod:
    """A FusedMoE layer's experts in their GGUF blocks: `types` maps w1 / w3 / w2 to GGML
    block type names (quantization/gguf.py GGUF_TYPES)."""

    def __init__(self, types: dict[str, str], batch_invariant: bool = True) -> None:
        missing = {"w1", "w3", "w2"} - set(types)
        if missing:
            raise ValueError(f"the GGUF file has no expert weights {sorted(missing)} here")
        self.types, self.batch_invariant = types, batch_invariant

    def create_weights(self, layer: nn.Module) -> None:
        """Replace the layer's float w13 / w2 by raw block rows (uint8), this rank's share,
        loaded expert by expert through `weight_loader`."""
        E, hidden, inter = layer.num_experts, layer.w2.shape[1], layer.shard
        for shard, k in (("w1", hidden), ("w3", hidden), ("w2", inter)):
            t = GGUF_TYPES[self.types[shard]]
            if k % t.weights:
                split = (f" (its {layer.tp.tp_size} tensor-parallel shares of "
                         f"{k * layer.tp.tp_size})" if shard == "w2" and layer.tp.tp_size > 1
                         else "")
                raise ValueError(f"GGUF {t.name} expert rows of {k} weights{split} are not "
                                 f"whole blocks of {t.weights}")
        gate_up = max(GGUF_TYPES[self.types[s]].row_bytes(hidden) for s in ("w1", "w3"))
        shapes = {"w13": (E, 2 * inter, gate_up),
                  "w2": (E, hidden, GGUF_TYPES[self.types["w2"]].row_bytes(inter))}
        for name, shape in shapes.items():
            shards = getattr(layer, name).expected_shards
            # (empty: a narrower part's padding is never read)
            param = nn.Parameter(torch.empty(shape, dtype=torch.uint8), requires_grad=False)
            param.weight_loader = functools.partial(self.weight_loader, self._share(layer))
            param.expected_shards = shards
            replace_param(layer, name, None)
            layer.register_parameter(name, param)
        layer.gguf_sizes = (hidden, inter)

    def _share(self, layer: nn.Module) -> dict[str, tuple[slice, slice]]:
        """This rank's (rows, bytes of each row) of an expert's w1 / w3 (I, bytes) and w2
        (H, bytes): its I / tp rows, its I / tp columns."""
        inter, lo = layer.shard, layer.tp.tp_rank * layer.shard
        w2 = GGUF_TYPES[self.types["w2"]]
        everything = slice(None)
        return {"w1": (slice(lo, lo + inter), everything),
                "w3": (slice(lo, lo + inter), everything),
                "w2": (everything, slice(w2.row_bytes(lo), w2.row_bytes(lo + inter)))}

    @staticmethod
    @torch.no_grad()
    def weight_loader(share: dict[str, tuple[slice, slice]], param: nn.Parameter,
                      tensor: torch.Tensor, shard: tuple[int, str]) -> None:
        """One expert's raw rows, this rank's share (`share`): w1 / w3 (I, bytes) into its
        half of w13, w2 (H, bytes)."""
        e, name = shard
        if tensor.dtype != torch.uint8:
            raise ValueError(f"expert {e} {name}: expected GGUF block rows, got {tensor.dtype}")
        tensor = tensor[share[name]]
        rows = tensor.shape[0]
        first = rows if name == "w3" else 0
        expected = param.shape[1] // (1 if name == "w2" else 2)
        if rows != expected or tensor.shape[1] > param.shape[2]:
            raise ValueError(f"expert {e} {name}: {tuple(tensor.shape)} block rows do not fit "
                             f"this layer's ({expected}, <= {param.shape[2]} bytes)")
        param.data[e, first:first + rows, :tensor.shape[1]].copy_(tensor)

    def _parts(self, name: str, hidden: int, inter: int) -> list[tuple[str, int, int, int]]:
        """Matrix `name`'s parts (the shard whose type it has, first row, rows, K): gate and
        up as one part where their types agree, else each its own."""
        if name == "w2":
            return [("w2", 0, hidden, inter)]
        if self.types["w1"] == self.types["w3"]:
            return [("w1", 0, 2 * inter, hidden)]
        return [("w1", 0, inter, hidden), ("w3", inter, inter, hidden)]

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Each matrix's parts as their kernels' tensors, stacked over experts:
        `<name>_p<part>_<i>` (E, ...)."""
        hidden, inter = layer.gguf_sizes
        for name in ("w13", "w2"):
            raw = getattr(layer, name).data
            replace_param(layer, name, None)
            for p, (shard, row, rows, k) in enumerate(self._parts(name, hidden, inter)):
                type_name = self.types[shard]
                cut = raw[:, row:row + rows, :GGUF_TYPES[type_name].row_bytes(k)]
                if GGUF_TYPES[type_name].split is None and cut.is_contiguous():
                    replace_param(layer, f"{name}_p{p}_0", cut)  # the loaded bytes, no copy
                    continue
                per_expert = [kernel_tensors(cut[e], type_name) for e in range(cut.shape[0])]
                for i in range(len(per_expert[0])):
                    stacked = torch.stack([t[i] for t in per_expert]).contiguous()
                    replace_param(layer, f"{name}_p{p}_{i}", stacked)

    def kernel(self, layer: nn.Module, name: str, e: int) -> CPULinearKernel:
        """Expert e's `name` (w13 | w2) matrix as the C++ linear op reads it."""
        parts = []
        for p, (shard, *_) in enumerate(self._parts(name, *layer.gguf_sizes)):
            tensors = []
            while (t := getattr(layer, f"{name}_p{p}_{len(tensors)}", None)) is not None:
                tensors.append(t[e])
            parts.append(CPULinearKernel(GGUF_TYPES[self.types[shard]].kind, 32,
                                         tuple(tensors), batch_invariant=self.batch_invariant))
        return merged_kernel(parts, batch_invariant=self.batch_invariant)
