"""GGUF weights served in their own block form (`quantization="gguf"`), as llama.cpp does.

Each GGML type the kernels read is one registered `GGUFType` (GGUF_TYPES): its block size,
bytes per block, the kernel kind that reads it and, for the oldest three, how its blocks split
into the kernels' struct-of-arrays form; adding a type is one entry here and one block reader
in csrc/linear_gguf.h. The loader (model_loader/gguf_loader.py `iterate_gguf` with raw_types)
hands each quantized tensor over as its raw uint8 block rows (N, bytes per row);
llama.cpp's q/k row permutation moves whole rows, so un-permuting raw rows needs no
requantizing. A layer whose kernels read every part's blocks as stored (`in_place`: no split)
keeps the loaded tensors themselves, per part (`held_parts`): views of the file's private map,
used in place, never copied (the q / k rows un-permuted are copies). Q4_K, the bulk of most
K-quant files, is the exception on the AVX2 and AVX-512 builds: packed from those views into
tiles of 16 rows (quantization/kquant_tiles.py, block_tiles.py; on AVX-512 VNNI its kernels
read a decode step's weights at ~1.9x the raw rows' rate) and the map's pages released, as
llama.cpp repacks it.

    Q8_0  d + 32 x int8               → Q8_0 (q, d)                     split, bit for bit
    Q4_1  d, m + 16 B nibbles         → Q4 (q, d, m), G = 32            split, bit for bit
    Q4_0  d + 16 B nibbles            → Q4 with m = -8 d (exact)        split, bit for bit
    Q5_0, Q5_1, IQ4_NL,               raw block rows read in place (csrc/linear_gguf.h),
    Q2_K, Q3_K, Q4_K, Q5_K, Q6_K,     every weight as gguf dequantizes it; products with x
    IQ4_XS
           (IQ4: a table's levels)    rounded to int16 per 256 values (SIMD builds,
                                      csrc/linear_gguf_rows.h, linear_gguf_vnni.h), exact
                                      on the portable build; with int8_activations the
                                      K-quants Q2_K .. Q6_K meet x rounded to int8 per 256
                                      (csrc/linear_gguf_int8.h; GGUFType.int8_activations)
    with int8_activations: Q5_0, IQ4_NL → Q8_0 (q - 16 or the level, d)   exact, 34 B a block
                                      (their values are int8s times the block's d), then
                                      Q8_0's int8 kernels (GGUFType.int8_as); Q5_1 and
                                      IQ4_XS have none (refused by name)
F32 tensors are served dense, F16 / BF16 ones dense in their own precision (widened to float32
in registers by the kernels, csrc/linear_half.h; BF16 ones multiplied in bfloat16 under
ModelConfig.matmul_dtype, by default on AVX512-BF16 CPUs for a file of BF16 tensors,
csrc/linear_bf16.h). Other types (IQ1-IQ3, TQ*, ...) are refused
at start-up with the list of supported ones. A merged layer (qkv, gate_up) whose parts have
different types (Q4_K_M files store some attn_v in Q6_K beside Q4_K q and k) keeps one
kernel per part (CPULinearKernel.PARTS): the checkpoint's parts arrive padded to the widest
part's row (`checkpoint_tensor`) and are cut back after loading.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from fractions import Fraction

import torch
from torch import nn

from tokenmill.quantization import block_tiles
from tokenmill.quantization.base import (
    CPULinearKernel,
    LinearMethodBase,
    QuantizationConfig,
    int8_activations_for,
    merged_kernel,
    new_param,
    replace_param,
)
from tokenmill.quantization.unquantized import UnquantizedLinearMethod
from tokenmill.utils.cpp_extension import runtime_isa
from tokenmill.utils.file_maps import MADV_DONTNEED, advise_tensor_pages
from tokenmill.utils.huge_pages import keep_pages

logger = logging.getLogger(__name__)

Split = Callable[[torch.Tensor], tuple[torch.Tensor, ...]]


def _f16(b: torch.Tensor, at: int) -> torch.Tensor:
    """The float16 field at byte `at` of every block of b (N, blocks, nbytes) → (N, blocks)."""
    return b[:, :, at:at + 2].contiguous().view(torch.float16).view(b.shape[0], -1)


def _split_q8_0(b: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return b[:, :, 2:].contiguous().view(torch.int8).view(b.shape[0], -1), _f16(b, 0)


def _split_q4_1(b: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return b[:, :, 4:].reshape(b.shape[0], -1).contiguous(), _f16(b, 0), _f16(b, 2)


def _split_q4_0(b: torch.Tensor) -> tuple[torch.Tensor, ...]:
    d = _f16(b, 0)
    return b[:, :, 2:].reshape(b.shape[0], -1).contiguous(), d, (d.float() * -8).half()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """(N, blocks, 16) bytes → (N, K) values: byte j's low nibble is weight j of its block, its
    high nibble weight j + 16 (ggml's order; blocks.unpack_q4's, which this module cannot
    import: blocks.dequantize reads this registry)."""
    return torch.cat([qs & 0x0F, qs >> 4], dim=-1).view(qs.shape[0], -1)


def _q5_0_as_q8_0(b: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Q5_0 blocks (d, 32 high bits, 16 B nibbles; w = d (q - 16)) as Q8_0 (q - 16, d):
    q - 16 is in [-16, 15], so the same d and int8 values give every weight exactly."""
    N = b.shape[0]
    qh = b[:, :, 2:6].contiguous().view(torch.int32)  # (N, blocks, 1), bit j: weight j
    high = ((qh >> torch.arange(32, dtype=torch.int32)) & 1).view(N, -1)  # (N, K)
    q = _nibbles(b[:, :, 6:22]).to(torch.int32) | (high << 4)
    return (q - 16).to(torch.int8), _f16(b, 0)


# IQ4_NL's 16 levels (ggml's kvalues_iq4nl): int8 values, a block's weights d * level
IQ4_NL_LEVELS = torch.tensor([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53,
                              69, 89, 113], dtype=torch.int8)


def _iq4_nl_as_q8_0(b: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """IQ4_NL blocks (d, 16 B nibbles indexing IQ4_NL_LEVELS) as Q8_0 (the levels, d): the
    levels are int8, so every weight is exact."""
    return IQ4_NL_LEVELS[_nibbles(b[:, :, 2:18]).long()], _f16(b, 0)


@dataclass(frozen=True)
class GGUFType:
    """A GGML block type the kernels read: `weights` per block of `nbytes`, read by kernel
    `kind`; `split` turns raw block rows (N, blocks, nbytes) into the kernel's tensors, None
    where the kernel reads the raw rows themselves; `int8_activations`: whether its kernels
    can multiply int8-rounded activations (raw K-quants: on AVX2 / AVX-512 builds,
    csrc/linear_gguf_int8.h). `int8_as`: for a type without such kernels whose weights
    another type holds exactly, that type and the split into its tensors, taken with int8
    activations (more bytes per weight, the other type's int8 kernels)."""

    name: str
    weights: int
    nbytes: int
    kind: int
    split: Split | None = None
    int8_activations: bool = False
    int8_as: tuple[str, Split] | None = None

    def row_bytes(self, k: int) -> int:
        return k // self.weights * self.nbytes

    def served(self, int8_activations: bool) -> tuple[GGUFType, Split | None]:
        """The type whose kernel multiplies these blocks, and the split into its tensors."""
        if int8_activations and self.int8_as is not None:
            name, split = self.int8_as
            return GGUF_TYPES[name], split
        return self, self.split


GGUF_TYPES = {t.name: t for t in (
    GGUFType("Q8_0", 32, 34, CPULinearKernel.Q8_0, _split_q8_0, True),
    GGUFType("Q4_1", 32, 20, CPULinearKernel.Q4, _split_q4_1, True),
    GGUFType("Q4_0", 32, 18, CPULinearKernel.Q4, _split_q4_0, True),
    GGUFType("Q5_0", 32, 22, CPULinearKernel.Q5_0, int8_as=("Q8_0", _q5_0_as_q8_0)),
    GGUFType("Q5_1", 32, 24, CPULinearKernel.Q5_1),
    GGUFType("Q4_K", 256, 144, CPULinearKernel.Q4_K, int8_activations=True),
    GGUFType("Q5_K", 256, 176, CPULinearKernel.Q5_K, int8_activations=True),
    GGUFType("Q6_K", 256, 210, CPULinearKernel.Q6_K, int8_activations=True),
    GGUFType("Q3_K", 256, 110, CPULinearKernel.Q3_K, int8_activations=True),
    GGUFType("Q2_K", 256, 84, CPULinearKernel.Q2_K, int8_activations=True),
    GGUFType("IQ4_XS", 256, 136, CPULinearKernel.IQ4_XS),
    GGUFType("IQ4_NL", 32, 18, CPULinearKernel.IQ4_NL, int8_as=("Q8_0", _iq4_nl_as_q8_0)),
)}
BLOCK_TYPES = tuple(GGUF_TYPES)
DENSE_TYPES = ("F32", "F16", "BF16")
SUPPORTED_TYPES = (*BLOCK_TYPES, *DENSE_TYPES)


def kernel_tensors(raw: torch.Tensor, type_name: str,
                   int8_activations: bool = False) -> tuple[torch.Tensor, ...]:
    """Raw block rows (N, K / QK * block bytes) uint8 → the tensors of the kernel that serves
    them (module doc; with int8 activations, GGUFType.int8_as)."""
    t = GGUF_TYPES[type_name]
    split = t.served(int8_activations)[1]
    if split is None:
        return (raw.contiguous(),)
    return split(raw.view(raw.shape[0], -1, t.nbytes))



def _check_int8_activations(type_names: list[str]) -> None:
    """Refuse int8 activations for types whose kernels lack them, by name."""
    served = {n: GGUF_TYPES[n].served(True)[0] for n in type_names}
    without = sorted({n for n, t in served.items() if not t.int8_activations})
    if without:
        have = ", ".join(n for n, t in GGUF_TYPES.items() if t.served(True)[0].int8_activations)
        raise ValueError(f"int8_activations is not implemented for GGUF {', '.join(without)} "
                         f"weights ({have} have it); leave it off")
    raw = sorted({n for n, t in served.items() if t.split is None})
    if raw and runtime_isa() not in ("avx2", "avx512"):
        raise ValueError(f"int8_activations for GGUF {', '.join(raw)} weights needs an AVX2 "
                         "or AVX-512 CPU; leave it off")


class GGUFBlockMethod(LinearMethodBase):
    """A layer whose GGUF tensors are block types: one type, or one per merged part."""

    def __init__(self, type_names: list[str], batch_invariant: bool = True,
                 int8_activations: bool = False) -> None:
        self.type_names = type_names
        self.batch_invariant = batch_invariant
        self.int8_activations = int8_activations
        if int8_activations:
            _check_int8_activations(type_names)
        # every part's kernel reads the blocks as the file stores them: the loader hands
        # them over as views of the file's map, and the layer keeps those (module doc)
        self.in_place = all(GGUF_TYPES[n].served(int8_activations)[1] is None
                            for n in type_names)

    def create_weights(self, layer: nn.Module, input_size: int, output_sizes: list[int],
                       dtype: torch.dtype) -> None:
        types = [GGUF_TYPES[n] for n in self.type_names]
        for t in types:
            if input_size % t.weights:
                raise ValueError(f"GGUF {t.name} rows of {input_size} weights are not whole "
                                 f"blocks of {t.weights}")
        widest = max(types, key=lambda t: t.row_bytes(input_size))
        layer.gguf_input_size = input_size
        layer.gguf_parts = list(zip(self.type_names, output_sizes, strict=False)) \
            if len(types) > 1 else [(self.type_names[0], sum(output_sizes))]
        layer.qweight = new_param((sum(output_sizes), widest.row_bytes(input_size)),
                                  torch.uint8, output_dim=0, input_dim=1,
                                  input_ratio=Fraction(widest.nbytes, widest.weights))
        if self.in_place and layer.qweight.is_cpu:
            # each part's loaded rows kept as they are (layers/linear.py fill_span); the
            # merged parameter is never written, so its pages are never touched
            layer.qweight.held_parts = {}

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        raw, K = layer.qweight.data, layer.gguf_input_size
        held = getattr(layer.qweight, "held_parts", {})
        replace_param(layer, "qweight", None)
        row = 0
        for p, (name, rows) in enumerate(layer.gguf_parts):
            part = _held_part(held, row, rows, name, K) if held else \
                raw[row:row + rows, :GGUF_TYPES[name].row_bytes(K)]
            kernel = CPULinearKernel(GGUF_TYPES[name].served(self.int8_activations)[0].kind, 32,
                                     kernel_tensors(part, name, self.int8_activations),
                                     self.int8_activations)
            packed = block_tiles.packed_for(layer, kernel)  # Q8_0, Q4_x, Q6_K (VNNI), Q4_K
            if held and packed is not kernel:  # a copy now: the map's pages can go
                advise_tensor_pages(part, MADV_DONTNEED)
            kernel = packed
            for i, t in enumerate(kernel.tensors):
                replace_param(layer, f"blocks_{p}_{i}", t.contiguous())
                if i == 0 and kernel.kind in block_tiles.BLOCK_KIND:
                    # packed tiles, written once into huge pages where they are (the
                    # scales beside them are ordinary copies: they go to the arena)
                    keep_pages(getattr(layer, f"blocks_{p}_{i}"))
            row += rows

    def _part_kernel(self, layer: nn.Module, p: int, name: str) -> CPULinearKernel:
        tensors = []  # blocks_{p}_0, _1, ... as process_weights_after_loading registered them
        while (t := getattr(layer, f"blocks_{p}_{len(tensors)}", None)) is not None:
            tensors.append(t)
        kind = GGUF_TYPES[name].served(self.int8_activations)[0].kind
        return CPULinearKernel(block_tiles.held_kind(kind, tensors[0]), 32, tuple(tensors),
                               self.int8_activations, None, self.batch_invariant)

    def cpu_kernel(self, layer: nn.Module) -> CPULinearKernel | None:
        first = getattr(layer, "blocks_0_0", None)
        if first is None or not first.is_cpu:
            return None
        parts = [self._part_kernel(layer, p, n) for p, (n, _) in enumerate(layer.gguf_parts)]
        return merged_kernel(parts, self.int8_activations, self.batch_invariant)


def _held_part(held: dict[int, torch.Tensor], row: int, rows: int, name: str,
               K: int) -> torch.Tensor:
    """The loaded rows of the part starting at `row`, as the loader handed them over."""
    part, width = held.get(row), GGUF_TYPES[name].row_bytes(K)
    if part is None:
        raise ValueError(f"no checkpoint tensor was loaded for the GGUF {name} rows at {row}")
    if part.dtype != torch.uint8 or tuple(part.shape) != (rows, width):
        raise ValueError(f"GGUF {name} rows of {K} weights take {width} bytes; the "
                         f"checkpoint's part at row {row} is {part.dtype} {tuple(part.shape)}")
    return part


class GGUFConfig(QuantizationConfig):
    """Each layer's method from the types of its tensors in the file."""

    name = "gguf"

    def __init__(self, tensor_types: dict[str, str], prepack: bool,
                 packed_modules: dict[str, tuple[str, int | str]],
                 int8_activations: bool = False, batch_invariant: bool = True,
                 matmul_dtype: torch.dtype | None = None) -> None:
        self.int8_activations = int8_activations
        self.batch_invariant = batch_invariant
        # HF parameter name ("model.layers.0.self_attn.q_proj.weight") → GGML type name
        self.tensor_types = tensor_types
        # F16 / BF16 tensors stay in their half precision (the kernels widen them, or BF16
        # ones meet bf16 activations: matmul_dtype); F32 dense
        self.dense = {"F32": UnquantizedLinearMethod(prepack, batch_invariant),
                      "F16": UnquantizedLinearMethod(prepack, batch_invariant, torch.float16),
                      "BF16": UnquantizedLinearMethod(prepack, batch_invariant,
                                                      torch.bfloat16, matmul_dtype)}
        self.packed_modules = packed_modules
        bad = sorted({t for t in tensor_types.values() if t not in SUPPORTED_TYPES})
        if bad:
            raise ValueError(f"GGUF tensor types {', '.join(bad)} cannot be served natively "
                             f"(quantization='gguf' supports {', '.join(SUPPORTED_TYPES)}); "
                             "pass quantization='none' to serve the file dequantized to float32")
        if int8_activations:
            for name in sorted({t for t in tensor_types.values() if t in GGUF_TYPES}):
                held, _ = GGUF_TYPES[name].served(True)
                if held.name != name:
                    logger.info("int8 activations: the GGUF %s blocks of layers that take them "
                                "are held as %s blocks of the same weights (exact; %d bytes a "
                                "block)", name, held.name, held.nbytes)

    def _parts_of(self, prefix: str) -> list[str]:
        """The checkpoint tensors (weight names) that make up the module at `prefix`, in the
        merged layer's shard order."""
        parent, _, leaf = prefix.rpartition(".")
        parts = [(shard, f"{parent}.{ckpt}.weight")
                 for ckpt, (merged, shard) in self.packed_modules.items() if merged == leaf]
        if not parts:
            return [f"{prefix}.weight"]
        order = {"q": 0, "k": 1, "v": 2}
        return [n for _, n in sorted(parts, key=lambda p: order.get(p[0], p[0]))]  # type: ignore[arg-type]

    def _types_of(self, prefix: str) -> list[str]:
        names = self._parts_of(prefix)
        found = [self.tensor_types.get(n) for n in names]
        if None in found:
            raise ValueError(f"the GGUF file has no weight for {prefix}")
        return found  # type: ignore[return-value]

    def linear_method(self, prefix: str) -> LinearMethodBase:
        types = self._types_of(prefix)
        dense = [t in DENSE_TYPES for t in types]
        if all(dense):
            return self.dense[types[0] if len(set(types)) == 1 else "F32"]
        if any(dense):
            raise ValueError(f"{prefix} merges dense and block GGUF tensors ({types}); "
                             "pass quantization='none' to serve the file in float32")
        return GGUFBlockMethod(types, self.batch_invariant,
                               int8_activations_for(prefix, self.int8_activations))

    def embedding_method(self, prefix: str) -> LinearMethodBase:
        """As linear_method, but float activations always: rounding them cost most agreement
        in the logits (benchmarks/RESULTS.md)."""
        method = self.linear_method(prefix)
        if isinstance(method, GGUFBlockMethod) and method.int8_activations:
            return GGUFBlockMethod(method.type_names, self.batch_invariant)
        return method

    def checkpoint_tensor(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """Raw rows of one part of a merged layer whose parts differ in type, zero-padded to
        the widest part's row (GGUFBlockMethod cuts each part back after loading), unless the
        layer holds its parts as loaded (GGUFBlockMethod.in_place)."""
        if not name.endswith(".qweight") or tensor.dtype != torch.uint8 or ".experts." in name:
            return tensor  # (experts: gguf_experts.py pads gate / up itself)
        weight = name[:-len("qweight")] + "weight"
        parent = weight.rpartition(".")[0]
        module = parent.rpartition(".")[2]
        entry = self.packed_modules.get(module)
        if entry is None:
            return tensor
        merged = f"{parent.rpartition('.')[0]}.{entry[0]}"
        types = self._types_of(merged)
        method = self.linear_method(merged)
        if len(set(types)) == 1 or (isinstance(method, GGUFBlockMethod) and method.in_place):
            return tensor  # (a layer holding its parts keeps each at its own width)
        own = GGUF_TYPES[self.tensor_types[weight]]
        K = tensor.shape[1] // own.nbytes * own.weights
        widest = max(GGUF_TYPES[t].row_bytes(K) for t in types)
        if widest == tensor.shape[1]:
            return tensor
        return torch.nn.functional.pad(tensor, (0, widest - tensor.shape[1]))
