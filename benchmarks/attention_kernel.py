"""The CPU paged-attention kernel (csrc/paged_attention_cpu.cpp) on decode shapes, optionally
against other versions of its source, timed interleaved in one process.

    python benchmarks/attention_kernel.py [--compare OLD.cpp ...] [--reps 7]

SmolLM2's heads (9 query heads, 3 KV heads of 64), 16-token blocks scattered through a 200 MB
pool. Shapes: 64 decodes over 1,100 / 320 / 80 cached tokens, 64 decodes' own 76 tokens after a
cascade's shared prefix, and one decode over 1,000 tokens (keys split across threads). Each
version is built under its own module name (`git show REV:tokenmill/csrc/paged_attention_cpu.cpp
> old.cpp` gives an older one); every repetition runs all versions back to back, so machine noise
hits them alike, and the median per call is printed.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
from pathlib import Path

import torch
from torch.utils.cpp_extension import load

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tokenmill.bench.alternate import alternate  # noqa: E402
from tokenmill.utils.cpp_extension import CSRC, cflags  # noqa: E402

# (rows, first cached token attended, context length)
SHAPES = [(64, 0, 1100), (64, 0, 320), (64, 0, 80), (64, 1024, 1100), (1, 0, 1000)]


def build(path: str) -> object:
    # The current source includes headers from csrc/ (an old one may not): hash them too.
    text = Path(path).read_bytes() + b"".join(h.read_bytes() for h in sorted(CSRC.glob("*.h")))
    digest = hashlib.sha256(text).hexdigest()[:10]
    return load(f"attn_bench_{digest}", [path], extra_cflags=cflags(),
                extra_include_paths=[str(CSRC)], extra_ldflags=["-fopenmp"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--compare", nargs="*", default=[], help="other versions of the source")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--calls", type=int, default=10, help="calls per timing")
    args = ap.parse_args()
    versions = {"current": str(CSRC / "paged_attention_cpu.cpp")}
    versions.update({os.path.basename(p): p for p in args.compare})
    ops = {name: build(path).paged_attention for name, path in versions.items()}

    num_blocks, bs, hkv, d, hq = 8000, 16, 3, 64, 9
    gen = torch.Generator().manual_seed(0)
    k_cache, v_cache = torch.randn(num_blocks, bs, hkv, d), torch.randn(num_blocks, bs, hkv, d)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; median ms per call")
    print(f"{'rows x keys':<22}" + "".join(f"{n:>16}" for n in ops))
    for rows, start, ctx in SHAPES:
        max_blocks = -(-ctx // bs)
        tables = torch.randperm(num_blocks - 1, generator=gen)[:rows * max_blocks].add(1)
        args_ = (torch.randn(rows, hq, d), k_cache, v_cache, tables.view(rows, max_blocks),
                 torch.arange(rows), torch.full((rows,), start), torch.full((rows,), ctx),
                 d ** -0.5)
        times = alternate({name: lambda op=op, a=args_: op(*a) for name, op in ops.items()},
                          args.reps, args.calls)
        label = f"{rows} x {ctx - start}" + (" (cascade)" if start else "")
        print(f"{label:<22}" + "".join(f"{t * 1e3:>16.3f}" for t in times.values()))


if __name__ == "__main__":
    main()
