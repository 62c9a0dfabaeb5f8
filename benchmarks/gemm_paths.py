"""GFLOP/s of the two CPU GEMM paths for more than SMALL_M rows, on SmolLM2's shapes, by rows:
oneDNN with the prepacked weight (what layers/linear.py uses) against F.linear (MKL sgemm) on
the dense weight, timed in alternation.

    python benchmarks/gemm_paths.py [--rows 16 64 128 256 512 2048]
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tokenmill.bench.alternate import alternate  # noqa: E402
from tokenmill.layers.cpu_gemm import packed_linear, prepack  # noqa: E402

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}


def gflops_pair(paths, x: torch.Tensor, calls: int, n: int, reps: int = 7) -> list[float]:
    """GFLOP/s of each (gemm, weight) in `paths`: `calls` back-to-back gemm(x, weight) per
    timing, the paths timed in alternation (so that the machine's drift hits both), median
    of `reps` timings each."""
    fns = {str(j): (lambda gemm=gemm, weight=weight: gemm(x, weight))
           for j, (gemm, weight) in enumerate(paths)}
    m, k = x.shape
    return [2.0 * m * n * k / t / 1e9 for t in alternate(fns, reps, calls, warmup=calls).values()]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="*", default=[16, 64, 128, 256, 512, 2048])
    args = ap.parse_args()
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; GFLOP/s "
          "prepacked oneDNN / F.linear")
    print(f"{'rows':>6}" + "".join(f"{name:>16}" for name in SHAPES) + f"{'all':>16}")
    for m in args.rows:
        cells, times = [], [0.0, 0.0]
        total = 0.0
        for n, k in SHAPES.values():
            w, x = torch.randn(n, k), torch.randn(m, k)
            calls = max(1, 40_000_000 // (m * n * k))  # ~80 MFLOP per timing
            a, b = gflops_pair([(packed_linear, prepack(w)), (F.linear, w)], x, calls, n)
            cells.append(f"{a:.0f} / {b:.0f}")
            flop = 2.0 * m * n * k
            total += flop
            times[0] += flop / a
            times[1] += flop / b
        cells.append(f"{total / times[0]:.0f} / {total / times[1]:.0f}")
        print(f"{m:>6}" + "".join(f"{c:>16}" for c in cells))


if __name__ == "__main__":
    main()
