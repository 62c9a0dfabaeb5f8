"""The CPU paged-attention kernel (csrc/paged_attention_cpu.cpp) on decode shapes, optionally
against other versions of its source, timed interleaved in one process.

    python benchmarks/attention_kernel.py [--compare OLD_CSRC_DIR|OLD.cpp ...] [--reps 7]
        [--kv-cache-dtype float32|bfloat16] [--layers 8] [--heads 32,8,128]

SmolLM2's heads (9 query heads, 3 KV heads of 64; --heads for another model's), 16-token
blocks scattered through a pool of 8,000 (200 MB in float32 at SmolLM2's heads, 100 MB in
bf16), one per --layers (the calls cycle through them). Shapes: 64
decodes over 1,100 / 320 / 80 cached tokens, 64 decodes' own 76 tokens after a cascade's
shared prefix, one decode over 1,000, 1,500 and 3,000 tokens (keys cut at multiples of 512, as
in batch-invariant mode, the CPU engine's default, and into the kernel's own chunks as without
it: "split 0"), 64 decodes over 1,100 tokens whose first 1,024 are the same blocks for
all (a shared prefix, attended whole by the kernel, as in batch-invariant mode), and prefill
chunks
(8 sequences of 256 queries, 2 of 512, each query attending its sequence up to itself).
Each version is built under its own module name: another checkout's csrc folder
(`git archive REV tokenmill/csrc | tar -x -C /tmp/old` gives /tmp/old/tokenmill/csrc) or a
single .cpp (built against this csrc's headers); every repetition runs all versions back to
back, so machine noise hits them alike, and the median per call is printed.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tokenmill.bench.alternate import alternate  # noqa: E402
from tokenmill.bench.kernel_builds import build_module  # noqa: E402
from tokenmill.bench.machine import describe_machine  # noqa: E402
from tokenmill.utils.cpp_extension import CSRC  # noqa: E402

# (rows, first cached token attended, context length)
SHAPES = [(64, 0, 1100), (64, 0, 320), (64, 0, 80), (64, 1024, 1100), (1, 0, 1000), (1, 0, 1500),
          (1, 0, 3000)]
# (sequences, queries each): prefill chunks, query j of a sequence attending tokens [0, j]
CHUNKS = [(8, 256), (2, 512)]
# (rows, shared cached tokens, context length): decodes whose contexts start with the same
# cached blocks (prefix caching's system prompt), all keys attended by the kernel
SHARED = [(64, 1024, 1100)]


def build(path: str, include: Path) -> object:
    return build_module(path, include, "attn_bench")


def version(path: str) -> tuple[str, Path]:
    """(the .cpp to build, its include folder) of a --compare entry."""
    if os.path.isdir(path):
        return os.path.join(path, "paged_attention_cpu.cpp"), Path(path)
    return path, CSRC


def cases(gen: torch.Generator, num_blocks: int, bs: int) -> list[tuple[str, tuple, int]]:
    """(label, (q rows, tables, seq_rows, start_lens, ctx_lens), split_keys) of every shape."""
    out = []
    for rows, start, ctx in SHAPES:
        max_blocks = -(-ctx // bs)
        tables = torch.randperm(num_blocks - 1, generator=gen)[:rows * max_blocks].add(1)
        label = f"{rows} x {ctx - start}" + (" (cascade)" if start else "")
        args = (rows, tables.view(rows, max_blocks), torch.arange(rows),
                torch.full((rows,), start), torch.full((rows,), ctx))
        out.append((label, args, 512))
        if rows == 1:  # a lone decode in the engine's default mode
            out.append((f"{label} (split 0)", args, 0))
    for rows, shared, ctx in SHARED:
        own = -(-ctx // bs) - shared // bs
        ids = torch.randperm(num_blocks - 1, generator=gen)[:shared // bs + rows * own].add(1)
        tables = torch.cat([ids[:shared // bs].repeat(rows, 1),
                            ids[shared // bs:].view(rows, own)], dim=1)
        out.append((f"{rows} x {ctx} ({shared} shared)",
                    (rows, tables, torch.arange(rows), torch.zeros(rows, dtype=torch.long),
                     torch.full((rows,), ctx)), 512))
    for seqs, queries in CHUNKS:
        max_blocks = -(-queries // bs)
        tables = torch.randperm(num_blocks - 1, generator=gen)[:seqs * max_blocks].add(1)
        out.append((f"{seqs} chunks x {queries}",
                    (seqs * queries, tables.view(seqs, max_blocks),
                     torch.arange(seqs).repeat_interleave(queries),
                     torch.zeros(seqs * queries, dtype=torch.long),
                     torch.arange(1, queries + 1).repeat(seqs)), 512))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--compare", nargs="*", default=[],
                    help="other versions: a csrc folder, or a .cpp")
    ap.add_argument("--kv-cache-dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--calls", type=int, default=10, help="calls per timing")
    ap.add_argument("--heads", default="9,3,64",
                    help="query heads, KV heads, head size (default SmolLM2's; e.g. 32,8,128 "
                         "for Llama-3.1-8B's)")
    ap.add_argument("--layers", type=int, default=1,
                    help="caches (layers) the calls cycle through: with 8, a case's K/V no "
                         "longer fit the last-level cache and are read from memory, as in a "
                         "model's step")
    args = ap.parse_args()
    versions = {"current": version(str(CSRC))}
    versions.update({os.path.basename(os.path.normpath(p)): version(p) for p in args.compare})
    ops = {name: build(*v).paged_attention for name, v in versions.items()}

    hq, hkv, d = (int(x) for x in args.heads.split(","))
    num_blocks, bs = 8000, 16
    dtype = getattr(torch, args.kv_cache_dtype)
    gen = torch.Generator().manual_seed(0)
    caches = [(torch.randn(num_blocks, bs, hkv, d, generator=gen).to(dtype),
               torch.randn(num_blocks, bs, hkv, d, generator=gen).to(dtype))
              for _ in range(args.layers)]
    print(describe_machine())
    print(f"{args.kv_cache_dtype} cache, {hq} / {hkv} heads of {d}, {args.layers} layer(s); "
          "median ms per call")
    print(f"{'rows x keys':<22}" + "".join(f"{n:>16}" for n in ops))
    for label, (rows, tables, seq_rows, starts, lens), split_keys in cases(gen, num_blocks, bs):
        q = torch.randn(rows, hq, d, generator=gen)
        rest = (tables, seq_rows, starts, lens, d ** -0.5, None, 0.0, split_keys)

        def every_layer(op, q=q, rest=rest):
            for k_cache, v_cache in caches:
                op(q, k_cache, v_cache, *rest)

        times = alternate({name: lambda op=op: every_layer(op) for name, op in ops.items()},
                          args.reps, args.calls)
        print(f"{label:<22}" + "".join(f"{t * 1e3 / args.layers:>16.3f}"
                                        for t in times.values()))


if __name__ == "__main__":
    main()
