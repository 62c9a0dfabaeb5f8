"""GFLOP/s of the CPU GEMM paths on SmolLM2's shapes, by rows, timed in alternation:
oneDNN with the prepacked float32 weight (what dense layers use), F.linear (MKL sgemm) on the
dense weight, and tokenmill's `linear` op on quantized weights (csrc/linear_cpu.h): Q8_0 and
4-bit groups of 32, with float activations (int16 per 32-block on AVX-512 VNNI builds;
elsewhere exact: float32 row kernels up to 16 rows, float32 tiles above) or int8 ones, held
as the loader holds them (q8, q4: packed for AMX-INT8 tiles where the CPU has them,
csrc/linear_block_tiles.h) or as stored (q8-blocks, q4-blocks: the row kernels); the
weight in bfloat16, widened to float32 (bf16) or multiplied in bfloat16 (bf16-products: AMX
tiles where the CPU has AMX-BF16, the weight packed for them as the loader packs it,
csrc/linear_bf16_amx.h, else vdpbf16ps where it has AVX512-BF16, csrc/linear_bf16.h;
bf16-products-vdp: vdpbf16ps even on AMX CPUs); the weight in float16, widened in registers
(f16: a float16 checkpoint's layers); torch's bf16 `F.linear` (oneDNN, bf16 outputs) on bf16
activations (torch-bf16).

    python benchmarks/gemm_paths.py [--rows 1 4 16 64 128 256 512 2048]
        [--paths onednn,mkl,q8,q8+int8acts,q4,q4+int8acts,q8-blocks,q4-blocks,bf16,
                 bf16-products,bf16-products-vdp,f16,torch-bf16]
        [--no-batch-invariant] [--cold]

The quantized paths are batch-invariant as the engine's default is (one kernel whatever the
rows); --no-batch-invariant times the fastest kernel for each row count instead (the GEMMs
of csrc/linear_int8_gemm.h from 10 rows on AVX-512 VNNI builds).

By default a path calls one weight, which stays in cache across the timed calls. --cold
cycles through copies of it (256 MB in bf16 in all), so that each call reads its weight from
memory, as the layers of a decode step are read: the rate a step of few rows gets.
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tokenmill.bench.alternate import alternate  # noqa: E402
from tokenmill.bench.machine import describe_machine  # noqa: E402
from tokenmill.layers import cpu_ops  # noqa: E402
from tokenmill.layers.cpu_gemm import packed_linear, prepack  # noqa: E402
from tokenmill.quantization import CPULinearKernel, block_tiles  # noqa: E402
from tokenmill.quantization.blocks import quantize_q4, quantize_q8_0  # noqa: E402

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}
COLD_BYTES = 256 << 20


def gflops_pair(paths, x: torch.Tensor, calls: int, n: int, reps: int = 7) -> list[float]:
    """GFLOP/s of each (gemm, weights) in `paths`: `calls` back-to-back gemm(x, weight) per
    timing, cycling through the path's weights (one, or --cold's copies), the paths timed in
    alternation (so that the machine's drift hits both), median of `reps` timings each."""
    def call(gemm, weights):
        turn = itertools.cycle(weights)
        return lambda: gemm(x, next(turn))

    fns = {str(j): call(gemm, weights) for j, (gemm, weights) in enumerate(paths)}
    m, k = x.shape
    return [2.0 * m * n * k / t / 1e9 for t in alternate(fns, reps, calls, warmup=calls).values()]


def copies_for(w: torch.Tensor, cold: bool) -> int:
    """How many copies of a weight a path cycles through: with --cold, enough for COLD_BYTES
    of bf16 (2 bytes a weight), far past the L3 cache, so that every call reads its weight
    from memory, as a decode step reads its layers."""
    return max(1, -(-COLD_BYTES // (2 * w.numel()))) if cold else 1


def path(name: str, w: torch.Tensor, invariant: bool = True):
    """(gemm, weight) of one named path for the float32 weight w."""
    if name == "onednn":
        return packed_linear, prepack(w)
    if name == "mkl":
        return F.linear, w
    if name == "bf16":
        return cpu_ops.linear, CPULinearKernel(CPULinearKernel.BF16, 0, (w.to(torch.bfloat16),))
    if name == "bf16-products" and cpu_ops.bf16_products_amx():  # as the loader packs it
        return cpu_ops.linear, CPULinearKernel(CPULinearKernel.BF16_TILES, 0,
                                               (cpu_ops.bf16_tiles(w.to(torch.bfloat16)),))
    if name in ("bf16-products", "bf16-products-vdp"):
        return cpu_ops.linear, CPULinearKernel(CPULinearKernel.BF16_PRODUCTS, 0,
                                               (w.to(torch.bfloat16),))
    if name == "f16":
        return cpu_ops.linear, CPULinearKernel(CPULinearKernel.F16, 0, (w.to(torch.float16),))
    if name == "torch-bf16":
        return (lambda x, wb: F.linear(x.to(torch.bfloat16), wb)), w.to(torch.bfloat16)
    base, _, acts = name.partition("+")
    if base not in ("q8", "q4", "q8-blocks", "q4-blocks") or acts not in ("", "int8acts"):
        raise SystemExit(f"unknown path {name!r}: onednn, mkl, q8, q4, q8-blocks, q4-blocks "
                         "(each also +int8acts), bf16, bf16-products, bf16-products-vdp, f16, "
                         "torch-bf16")
    kind, tensors = ((CPULinearKernel.Q8_0, quantize_q8_0(w)) if base.startswith("q8")
                     else (CPULinearKernel.Q4, quantize_q4(w, 32)))
    kernel = CPULinearKernel(kind, 32, tuple(tensors), int8_activations=acts == "int8acts",
                             batch_invariant=invariant)
    if not base.endswith("-blocks") and block_tiles.packs(kernel):  # as the loader packs it
        kernel = block_tiles.pack(kernel)
    return cpu_ops.linear, kernel


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="*", default=[16, 64, 128, 256, 512, 2048])
    ap.add_argument("--paths", default="onednn,mkl",
                    help="comma-separated: onednn, mkl, q8, q4, q8-blocks, q4-blocks (each "
                         "also +int8acts), bf16, bf16-products, bf16-products-vdp, f16, "
                         "torch-bf16")
    ap.add_argument("--batch-invariant", action=argparse.BooleanOptionalAction, default=True,
                    help="quantized paths: one kernel at every row count (the engine's default)")
    ap.add_argument("--cold", action="store_true",
                    help="cycle through copies of each weight (256 MB in bf16) so that every "
                         "call reads its weight from memory, as a decode step does")
    args = ap.parse_args()
    names = args.paths.split(",")
    torch.manual_seed(0)
    print(describe_machine())
    print(f"GFLOP/s {' / '.join(names)}; quantized paths "
          f"{'batch-invariant' if args.batch_invariant else 'not batch-invariant'}; weights "
          f"{'read from memory (--cold)' if args.cold else 'in cache'}")
    width = 6 * len(names) + 4
    print(f"{'rows':>6}" + "".join(f"{name:>{width}}" for name in SHAPES) + f"{'all':>{width}}")
    for m in args.rows:
        cells, times = [], [0.0] * len(names)
        total = 0.0
        for n, k in SHAPES.values():
            w, x = torch.randn(n, k), torch.randn(m, k)
            calls = max(1, 40_000_000 // (m * n * k))  # ~80 MFLOP per timing
            count = copies_for(w, args.cold)
            calls = max(calls, count)
            paths = []
            for name in names:
                made = [path(name, w, args.batch_invariant) for _ in range(count)]
                paths.append((made[0][0], [weight for _, weight in made]))
            rates = gflops_pair(paths, x, calls, n)
            cells.append(" / ".join(f"{r:.0f}" for r in rates))
            flop = 2.0 * m * n * k
            total += flop
            times = [t + flop / r for t, r in zip(times, rates, strict=True)]
        cells.append(" / ".join(f"{total / t:.0f}" for t in times))
        print(f"{m:>6}" + "".join(f"{c:>{width}}" for c in cells))


if __name__ == "__main__":
    main()
