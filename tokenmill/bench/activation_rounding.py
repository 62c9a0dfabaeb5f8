"""What rounding a linear layer's input costs in agreement with float32, before any kernel
is written for it: every linear layer of the model (not the LM head) takes its input
rounded by a candidate rule, on the float32 weights (for a GGUF file: the float32 expansion
of its own blocks, so the weights are the file's and only the activations change), scored
by teacher forcing as benchmarks/quant_quality.py does (mean KL, top-1 agreement,
perplexity against the unrounded model).

Rules, each per row and per 32 consecutive values (the blocks the CPU kernels round):
- `int16`: round(x / dx), dx = amax / 32767 (the default of the GGUF and int8 formats);
- `int8`: dx = amax / 127 (llama.cpp's Q8 activations, `--int8-activations`);
- `bf16`: x rounded to bfloat16 (what a bf16 checkpoint's products take);
- `mixK`: int8 for a block whose amax <= K * its mean |x|, int16 for the others (blocks
  without an outlier at int8's cost); the share of int8 blocks is printed;
- `rowK`: int8 for a block whose amax <= K * the row's RMS, int16 for the others.

Why: an int16 rounding costs two vpdpbusd per 4 weights where int8 costs one, so on a CPU
without AMX the quantized formats' batched products run at bf16's instruction rate at best;
whether a cheaper rule keeps >= 99.5% top-1 decides whether a faster kernel is worth writing.
This emulates the rules on float32 products (the kernels' integer sums are exact, so only
float32 summation order differs); it measures agreement only, never speed.

    python benchmarks/activation_rounding.py [--model FILE.gguf] [--rules int16,int8,bf16,mix4]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

from tokenmill.bench.machine import describe_machine
from tokenmill.bench.quant_quality import compare, score_windows, text_windows

BLOCK = 32
Rule = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def round_blocks(x: torch.Tensor, levels: float) -> torch.Tensor:
    """x (..., K) rounded per 32 values to integers times dx = amax / levels (half to even,
    as the kernels' rounding), returned as float values; a block of zeros stays zero."""
    b = x.reshape(-1, BLOCK)
    dx = b.abs().amax(-1, keepdim=True) / levels
    safe = torch.where(dx > 0, dx, torch.ones_like(dx))
    q = torch.round(b / safe).clamp(-levels, levels)
    return (q * dx).reshape(x.shape)


def _mixed(x: torch.Tensor, use_int8: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 where use_int8 (one flag per 32-block of x, (blocks, 1)), int16 elsewhere."""
    b = x.reshape(-1, BLOCK)
    out = torch.where(use_int8, round_blocks(b, 127.0), round_blocks(b, 32767.0))
    return out.reshape(x.shape), use_int8


def rule(name: str) -> Rule:
    """The rounding rule `name` (module doc): x → (rounded x, each block's int8 flag)."""
    def every(flag: bool, f: Callable[[torch.Tensor], torch.Tensor]) -> Rule:
        return lambda x: (f(x), torch.full((x.numel() // BLOCK, 1), flag))

    if name == "int16":
        return every(False, lambda x: round_blocks(x, 32767.0))
    if name == "int8":
        return every(True, lambda x: round_blocks(x, 127.0))
    if name == "bf16":
        return every(False, lambda x: x.to(torch.bfloat16).to(x.dtype))
    if name.startswith("mix"):
        k = float(name[3:])

        def mixed(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            b = x.reshape(-1, BLOCK).abs()
            return _mixed(x, b.amax(-1, keepdim=True) <= k * b.mean(-1, keepdim=True))
        return mixed
    if name.startswith("row"):
        k = float(name[3:])

        def by_row(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            rms = x.pow(2).mean(-1, keepdim=True).sqrt()  # (T, 1)
            amax = x.reshape(x.shape[0], -1, BLOCK).abs().amax(-1)  # (T, K / 32)
            return _mixed(x, (amax <= k * rms).reshape(-1, 1))
        return by_row
    raise SystemExit(f"unknown rule {name!r}: int16, int8, bf16, mixK, rowK")


def _round_inputs(layers: list, f: Rule | None, counts: list[int]) -> None:
    """Every layer's product takes its input through f; None: as it comes (the wrapper
    removed). counts: [blocks seen, of which int8]."""
    methods = {id(layer.quant_method): layer.quant_method for layer in layers}
    for method in methods.values():
        method.__dict__.pop("apply", None)  # the class's own product again
        if f is None:
            continue
        apply = method.apply

        def rounded(lay, x, bias=None, apply=apply):
            y, flags = f(x)
            counts[0] += flags.numel()
            counts[1] += int(flags.sum())
            return apply(lay, y, bias)
        method.apply = rounded


def main(argv: list[str] | None = None) -> int:
    from tokenmill import LLM
    from tokenmill.layers.linear import LinearBase

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct (GGUF Q4_1)")
    p.add_argument("--rules", default="int16,int8,bf16,mix4,mix6,row4,row8")
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--window", type=int, default=512)
    args = p.parse_args(argv)
    print(describe_machine())
    llm = LLM(args.model, quantization="none", matmul_dtype="float32",
              enable_prefix_caching=False, max_model_len=args.window + 8,
              max_num_batched_tokens=args.window)
    # The layers' own products: the fused CPU call would not see the wrapped inputs.
    llm.engine.runner.model.model.fused_layers.enabled = False
    windows = text_windows(llm.engine.tokenizer, args.tokens, args.window)
    layers = [m for m in llm.engine.runner.model.modules() if isinstance(m, LinearBase)]
    ref = score_windows(llm, windows)
    print(f"{len(layers)} linear layers; {sum(len(w) - 1 for w in windows)} scored tokens")
    print(f"{'rule':<8} {'mean KL':>9} {'top-1 agree':>12} {'perplexity':>11} "
          f"{'int8 blocks':>12}")
    for name in args.rules.split(","):
        counts = [0, 0]
        t0 = time.perf_counter()
        _round_inputs(layers, rule(name), counts)
        try:
            r = compare(ref, score_windows(llm, windows), windows)
        finally:
            _round_inputs(layers, None, counts)
        print(f"{name:<8} {r['kl']:>9.5f} {100 * r['top1']:>11.2f}% {r['ppl']:>11.3f} "
              f"{100 * counts[1] / max(1, counts[0]):>11.1f}%  "
              f"({time.perf_counter() - t0:.0f} s)", flush=True)
    return 0
