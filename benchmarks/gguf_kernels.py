"""How fast the GGUF block kernels read a layer's weights: tokenmill's `linear` op on raw
GGUF blocks (csrc/linear_gguf_rows.h on SIMD builds, linear_gguf_vnni.h for K-quants on
AVX-512 VNNI) at a few rows of x, per type, with
random blocks of one large layer shape (Llama-3.2-1B's ffn_down by default).

    python benchmarks/gguf_kernels.py [--types Q4_K,Q5_K,Q6_K,Q5_0,Q5_1]
        [--rows 1 4 16] [--shape 2048x8192] [--copies 6] [--activations int16,int8]

A decode step reads each weight once from memory, so each timing cycles through `--copies`
distinct weights of the shape (more bytes than the caches hold) and reports milliseconds per
layer and the rate at which the weight bytes went by (GB/s), beside the machine's own read
rate of a plain float32 sum over as many bytes. Types are timed in alternation (medians over
rounds, taken in one run); `--builds avx512,avx2` times the installed kernel builds side by
side in the same run (the AVX2 kernels run on an AVX-512 CPU too). `Q4_K_TILES` in --types
times the same Q4_K blocks packed into tiles of 16 rows as the loader packs them on the AVX2
and AVX-512 builds (quantization/kquant_tiles.py, csrc/linear_kquant_tiles.h); `Q6_K_TILES`
likewise Q6_K's, as the AVX-512 VNNI build packs them (quantization/q6k_tiles.py,
csrc/linear_q6k_tiles.h).
"""

from __future__ import annotations

import argparse
import functools
import importlib
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tokenmill.bench.alternate import alternate  # noqa: E402
from tokenmill.bench.machine import describe_machine  # noqa: E402
from tokenmill.bench.real_gguf import random_blocks  # noqa: E402
from tokenmill.layers import cpu_ops  # noqa: E402
from tokenmill.quantization import block_tiles  # noqa: E402
from tokenmill.quantization.base import CPULinearKernel  # noqa: E402
from tokenmill.quantization.gguf import GGUF_TYPES  # noqa: E402


def layer_copies(type_name: str, n: int, k: int, copies: int) -> list[CPULinearKernel]:
    """`copies` distinct (n, k) weights of random `type_name` blocks (Q4_K_TILES, Q6_K_TILES:
    Q4_K's or Q6_K's, packed)."""
    if type_name in ("Q4_K_TILES", "Q6_K_TILES"):
        stored = type_name.removesuffix("_TILES")
        return [block_tiles.pack(w) for w in layer_copies(stored, n, k, copies)]
    kind = GGUF_TYPES[type_name].kind
    return [CPULinearKernel(kind, 32, (torch.from_numpy(random_blocks(type_name, n, k, s)),))
            for s in range(copies)]


def with_int8_activations(kernels: list[CPULinearKernel]) -> list[CPULinearKernel]:
    """The same weights multiplying int8-rounded activations (csrc/linear_gguf_int8.h)."""
    return [CPULinearKernel(w.kind, w.group, w.tensors, int8_activations=True) for w in kernels]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--types", default="Q4_K,Q5_K,Q6_K,Q5_0,Q5_1",
                    help="GGUF types read in place (Q8_0 / Q4_x are split at load: gemm_paths.py)")
    ap.add_argument("--rows", type=int, nargs="*", default=[1, 4, 16])
    ap.add_argument("--shape", default="2048x8192", help="N x K of the layer")
    ap.add_argument("--copies", type=int, default=6)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--builds", default="",
                    help="comma-separated kernel builds to compare (avx512, avx2, generic; "
                         "default: the one this CPU runs)")
    ap.add_argument("--activations", default="int16",
                    help="comma-separated: int16 (the default rounding), int8 "
                         "(int8_activations=True: Q2_K .. Q6_K, Q8_0, Q4_0, Q4_1)")
    args = ap.parse_args()
    n, k = (int(v) for v in args.shape.split("x"))
    names = args.types.split(",")
    print(describe_machine())
    modes = args.activations.split(",")
    blocks = {t: layer_copies(t, n, k, args.copies) for t in names}
    weights = {(f"{t} int8" if mode == "int8" and len(modes) > 1 else t):
               (with_int8_activations(blocks[t]) if mode == "int8" else blocks[t])
               for t in names for mode in modes}
    types = list(weights)
    nbytes = {t: w[0].tensors[0].numel() for t, w in weights.items()}
    plain = torch.randn(args.copies, max(nbytes.values()) // 4)
    read = alternate({"sum": lambda: [row.sum() for row in plain]}, args.rounds, 1)["sum"]
    print(f"float32 sum over {args.copies} x {plain.shape[1] * 4 / 1e6:.1f} MB: "
          f"{plain.numel() * 4 / read / 1e9:.1f} GB/s")
    builds = {b: importlib.import_module(f"tokenmill._C.cpu_ops_{b}")
              for b in args.builds.split(",") if b}
    linears = {b: functools.partial(cpu_ops.linear, build=module)
               for b, module in builds.items()} or {"": cpu_ops.linear}
    print(f"layer {n} x {k}; ms per layer (GB/s of its weight)")
    columns = [(t, b) for t in types for b in linears]
    print(f"{'rows':>5}" + "".join(f"{f'{t} {b}'.strip():>18}" for t, b in columns))
    for m in args.rows:
        x = torch.randn(m, k)
        fns = {(t, b): (lambda w=weights[t], x=x, f=f: [f(x, kernel) for kernel in w])
               for t in types for b, f in linears.items()}
        seconds = alternate(fns, args.rounds, 1)
        cells = []
        for t, b in columns:
            per_layer = seconds[t, b] / args.copies
            cells.append(f"{per_layer * 1e3:.3f} ({nbytes[t] / per_layer / 1e9:.1f})")
        print(f"{m:>5}" + "".join(f"{c:>18}" for c in cells))


if __name__ == "__main__":
    main()
