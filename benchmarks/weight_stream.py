"""How fast each CPU weight path streams SmolLM2's float32 weights at batch 1 (a decode step's
GEMVs), against the machine's plain read bandwidth, in one run.

    python benchmarks/weight_stream.py [--rows 1] [--repeats 10]

Builds 30 layers of distinct random weights of SmolLM2's shapes (qkv 960x576, o 576x576,
gate_up 3072x576, down 576x1536) plus the 49152x576 LM head: 538 MB, far more than the
last-level cache, so every pass reads them from memory as a real decode step does. Prints
milliseconds per pass and GB/s for: torch's sum over one tensor of the same size (the read
bandwidth), `F.linear` (MKL), oneDNN on the dense weight, oneDNN on the prepacked weight, and
tokenmill's C++ small-M kernel (layers/cpu_ops.py), each also on a copy of the weights in
2 MiB transparent huge pages (utils/huge_pages.py, what the engine loads weights into). The
paths run interleaved for --rounds rounds and each prints its median, so that the machine's
drift hits all of them alike.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tokenmill.bench.alternate import alternate  # noqa: E402
from tokenmill.layers import cpu_ops  # noqa: E402
from tokenmill.layers.cpu_gemm import packed_linear, prepack  # noqa: E402
from tokenmill.quantization import CPULinearKernel  # noqa: E402
from tokenmill.utils import huge_pages  # noqa: E402

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=1, help="rows of x (batch), 1..4")
    ap.add_argument("--repeats", type=int, default=5, help="passes per timing")
    ap.add_argument("--rounds", type=int, default=6, help="interleaved timings per path")
    args = ap.parse_args()
    torch.manual_seed(0)
    weights = [torch.randn(n, k) for _ in range(30) for n, k in SHAPES]
    weights.append(torch.randn(49152, 576))
    nbytes = sum(w.numel() for w in weights) * 4
    xs = {k: torch.randn(args.rows, k) for k in (576, 1536)}
    flat = torch.randn(nbytes // 4)
    huge = torch.nn.ParameterList(torch.nn.Parameter(w.clone(), requires_grad=False)
                                  for w in weights)
    huge_pages.move_parameters_to_huge_pages(huge)
    flat_huge = huge_pages.zeros(flat.shape, flat.dtype).copy_(flat)
    packed = [prepack(w) for w in weights]
    paths = {
        "read bandwidth (torch.sum)": lambda: flat.sum(),
        "read bandwidth, huge pages": lambda: flat_huge.sum(),
        "F.linear (MKL)": lambda: [F.linear(xs[w.shape[1]], w) for w in weights],
        "oneDNN, dense weight": lambda: [torch.ops.mkldnn._linear_pointwise(
            xs[w.shape[1]], w, None, "none", [], "") for w in weights],
        "oneDNN, prepacked weight": lambda: [packed_linear(xs[w.shape[1]], p)
                                             for w, p in zip(weights, packed, strict=True)],
    }
    if cpu_ops.ops_available():
        dense = [CPULinearKernel(CPULinearKernel.DENSE, 0, (w,)) for w in weights]
        dense_huge = [CPULinearKernel(CPULinearKernel.DENSE, 0, (w,)) for w in huge]
        paths["tokenmill linear (small M)"] = lambda: [
            cpu_ops.linear(xs[k.tensors[0].shape[1]], k) for k in dense]
        paths["tokenmill linear, huge pages"] = lambda: [
            cpu_ops.linear(xs[k.tensors[0].shape[1]], k) for k in dense_huge]
    print(f"THP mode: {huge_pages.thp_mode() or 'none'}")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"{nbytes / 1e6:.0f} MB of float32 weights, {args.rows} row(s)")
    print(f"{'path':<30}{'ms':>8}{'GB/s':>8}")
    for name, t in alternate(paths, args.rounds, args.repeats, warmup=2).items():
        print(f"{name:<30}{t * 1e3:>8.1f}{nbytes / t / 1e9:>8.1f}")


if __name__ == "__main__":
    main()
