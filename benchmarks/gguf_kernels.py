"""How fast the GGUF block kernels read a layer's weights: tokenmill's `linear` op on raw
GGUF blocks (csrc/linear_gguf_rows.h on SIMD builds) at a few rows of x, per type, with
random blocks of one large layer shape (Llama-3.2-1B's ffn_down by default).

    python benchmarks/gguf_kernels.py [--types Q4_K,Q5_K,Q6_K,Q5_0,Q5_1]
        [--rows 1 4 16] [--shape 2048x8192] [--copies 6]

A decode step reads each weight once from memory, so each timing cycles through `--copies`
distinct weights of the shape (more bytes than the caches hold) and reports milliseconds per
layer and the rate at which the weight bytes went by (GB/s), beside the machine's own read
rate of a plain float32 sum over as many bytes. Types are timed in alternation (medians over
rounds, taken in one run); compare builds by running the script on each.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tokenmill.bench.alternate import alternate  # noqa: E402
from tokenmill.bench.machine import describe_machine  # noqa: E402
from tokenmill.bench.real_gguf import random_blocks  # noqa: E402
from tokenmill.layers import cpu_ops  # noqa: E402
from tokenmill.quantization.base import CPULinearKernel  # noqa: E402
from tokenmill.quantization.gguf import GGUF_TYPES  # noqa: E402


def layer_copies(type_name: str, n: int, k: int, copies: int) -> list[CPULinearKernel]:
    """`copies` distinct (n, k) weights of random `type_name` blocks."""
    kind = GGUF_TYPES[type_name].kind
    return [CPULinearKernel(kind, 32, (torch.from_numpy(random_blocks(type_name, n, k, s)),))
            for s in range(copies)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--types", default="Q4_K,Q5_K,Q6_K,Q5_0,Q5_1",
                    help="GGUF types read in place (Q8_0 / Q4_x are split at load: gemm_paths.py)")
    ap.add_argument("--rows", type=int, nargs="*", default=[1, 4, 16])
    ap.add_argument("--shape", default="2048x8192", help="N x K of the layer")
    ap.add_argument("--copies", type=int, default=6)
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()
    n, k = (int(v) for v in args.shape.split("x"))
    types = args.types.split(",")
    print(describe_machine())
    weights = {t: layer_copies(t, n, k, args.copies) for t in types}
    nbytes = {t: w[0].tensors[0].numel() for t, w in weights.items()}
    plain = torch.randn(args.copies, max(nbytes.values()) // 4)
    read = alternate({"sum": lambda: [row.sum() for row in plain]}, args.rounds, 1)["sum"]
    print(f"float32 sum over {args.copies} x {plain.shape[1] * 4 / 1e6:.1f} MB: "
          f"{plain.numel() * 4 / read / 1e9:.1f} GB/s")
    print(f"layer {n} x {k}; ms per layer (GB/s of its weight)")
    print(f"{'rows':>5}" + "".join(f"{t:>18}" for t in types))
    for m in args.rows:
        x = torch.randn(m, k)
        fns = {t: (lambda w=w, x=x: [cpu_ops.linear(x, kernel) for kernel in w])
               for t, w in weights.items()}
        seconds = alternate(fns, args.rounds, 1)
        cells = []
        for t in types:
            per_layer = seconds[t] / args.copies
            cells.append(f"{per_layer * 1e3:.3f} ({nbytes[t] / per_layer / 1e9:.1f})")
        print(f"{m:>5}" + "".join(f"{c:>18}" for c in cells))


if __name__ == "__main__":
    main()
