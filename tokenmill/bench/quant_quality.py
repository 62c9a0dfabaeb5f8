"""How much each weight format (or KV cache format, --kv-cache-dtype) changes the model:
mean KL divergence of the next-token distribution against float32, top-1 agreement, and
perplexity, over natural English text.

The text is found on the machine at run time: the docstrings of Python's standard library
(prose paragraphs only; doctest lines and code-like lines are dropped; the same source as
int4's calibration, quantization/awq_search.py, so int4's figures are in-domain), so nothing
is copied into the repository. It is cut into windows of --window tokens, each scored by teacher
forcing through the engine itself: a prefill with prompt logprobs, chunked into steps of
--step-tokens (default 4, so every linear layer runs the decode-sized kernels that
single-stream generation uses, int8 activations included; 512 measures the batched kernels),
with the model's `compute_logits` wrapped during the prompt-logprobs pass to keep the full
distributions. Methods are weight specs (bench/weight_specs.py): "gguf+int8acts" sets
int8_activations, "int4/64" int4's group size, "int4+rtn" turns its activation-aware search
off.

The float32 reference is the model with quantization="none": for a GGUF file, the float32
expansion of its own blocks (for the shipped SmolLM2 Q4_1 file there is no other float
checkpoint), so GGUF-native Q4_1 with float activations computes the very same weights and
only summation order differs; int8 / int4 quantize that float32 model again.
"""

from __future__ import annotations

import argparse
import math
import sys
import time

import torch

from tokenmill.bench.machine import describe_machine
from tokenmill.bench.weight_specs import weights_as
from tokenmill.quantization.awq_search import calibration_text


def score_windows(llm, windows: list[list[int]]) -> list[torch.Tensor]:
    """Teacher-forced next-token log-probabilities, (len(w) - 1, V) per window."""
    from tokenmill import SamplingParams
    from tokenmill.worker import model_runner

    model = llm.engine.runner.model
    real, real_prompt_logprobs = model.compute_logits, model_runner.prompt_logprobs
    captured: list[torch.Tensor] = []
    in_prompt_logprobs = [False]

    def keep(hidden: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        logits = real(hidden, idx)
        if in_prompt_logprobs[0]:  # not the sampling call
            captured.append(logits.float().log_softmax(-1))
        return logits

    def prompt_logprobs(*args: object) -> None:
        in_prompt_logprobs[0] = True
        try:
            real_prompt_logprobs(*args)
        finally:
            in_prompt_logprobs[0] = False

    model.compute_logits = keep
    model_runner.prompt_logprobs = prompt_logprobs  # what the runner calls
    try:
        out = []
        for w in windows:  # one at a time: the captures come back in order
            captured.clear()
            llm.generate([w], SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)
            out.append(torch.cat(captured))
            if out[-1].shape[0] != len(w) - 1:
                raise RuntimeError("a window was not scored in full")
        return out
    finally:
        model.compute_logits = real
        model_runner.prompt_logprobs = real_prompt_logprobs


def text_windows(tokenizer, tokens: int, window: int) -> list[list[int]]:
    """`tokens` tokens of the standard library's docstrings (module doc) cut into windows of
    `window` tokens (a last one of a single token dropped: nothing to score)."""
    ids: list[int] = []
    chars = 4 * tokens
    while len(ids) < tokens:
        ids = tokenizer.encode(calibration_text(chars), add_special_tokens=False)
        chars *= 2
    windows = [ids[i:i + window] for i in range(0, tokens, window)]
    return [w for w in windows if len(w) > 1]


def compare(ref: list[torch.Tensor], got: list[torch.Tensor],
            windows: list[list[int]]) -> dict[str, float]:
    kl = agree = nll = n = 0.0
    for r, g, w in zip(ref, got, windows, strict=True):
        targets = torch.tensor(w[1:])
        kl += float((r.exp() * (r - g)).sum())
        agree += float((r.argmax(-1) == g.argmax(-1)).sum())
        nll -= float(g.gather(1, targets.unsqueeze(1)).sum())
        n += r.shape[0]
    return {"kl": kl / n, "top1": agree / n, "ppl": math.exp(nll / n), "tokens": n}


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct (GGUF Q4_1)")
    p.add_argument("--methods", default=None,
                   help="comma-separated quantization methods to compare with float32 "
                        "(default: gguf,gguf+int8acts,int8,int8+int8acts,int4,int4/64,"
                        "int4/64+rtn; none when --kv-cache-dtype is given)")
    p.add_argument("--kv-cache-dtype", default="",
                   help="comma-separated KV cache formats (int8) to compare, with float32 "
                        "weights, against the float32 cache")
    p.add_argument("--matmul-dtype", default="",
                   help="bfloat16: a bfloat16 checkpoint's products in bfloat16 (with its "
                        "bfloat16 KV cache) against its float32 products (--model: a bf16 "
                        "folder, e.g. benchmarks/smollm2_bf16.py's)")
    p.add_argument("--tokens", type=int, default=4096, help="tokens of text to score")
    p.add_argument("--window", type=int, default=512)
    p.add_argument("--step-tokens", type=int, default=4,
                   help="prefill chunk per step (4: the decode kernels; 512: the GEMM ones)")
    args = p.parse_args(argv)
    if args.methods is None:
        args.methods = ("" if args.kv_cache_dtype or args.matmul_dtype else
                        "gguf,gguf+int8acts,int8,int8+int8acts,int4,int4/64,int4/64+rtn")
    return args


def _candidates(args: argparse.Namespace, opts: dict):
    """(label, engine options) for every variant compared with float32, in the table's order;
    build each engine before asking for the next (int4's load-time settings hold meanwhile)."""
    for spec in [m for m in args.methods.split(",") if m]:  # weight_specs.py
        with weights_as(spec) as weights:
            yield spec, weights | opts
    for kv in [k for k in args.kv_cache_dtype.split(",") if k]:
        yield f"f32, KV {kv}", dict(quantization="none", kv_cache_dtype=kv,
                                    matmul_dtype="float32") | opts
    for dtype in [d for d in args.matmul_dtype.split(",") if d]:
        # the KV format this dtype resolves to, filled in once the engine is built
        yield f"{dtype} products, KV {{kv}}", dict(quantization="none",
                                                   matmul_dtype=dtype) | opts


def main(argv: list[str] | None = None) -> int:
    from tokenmill import LLM

    args = _parse_args(argv)
    print(describe_machine())
    opts = dict(enable_prefix_caching=False, max_model_len=args.window + 8,
                max_num_batched_tokens=args.step_tokens)
    t0 = time.perf_counter()
    ref_llm = LLM(args.model, quantization="none", matmul_dtype="float32", **opts)
    windows = text_windows(ref_llm.engine.tokenizer, args.tokens, args.window)
    print(f"text: {sum(len(w) - 1 for w in windows)} scored tokens of standard-library "
          f"docstrings (Python {sys.version.split()[0]}), windows of {args.window}")
    ref = score_windows(ref_llm, windows)
    base = compare(ref, ref, windows)
    del ref_llm
    rows = [("float32", base)]
    for label, options in _candidates(args, opts):
        llm = LLM(args.model, **options)
        label = label.format(kv=llm.engine.config.cache.kv_cache_dtype)
        rows.append((label, compare(ref, score_windows(llm, windows), windows)))
        del llm
    print(f"\n{'weights':<30} {'mean KL':>10} {'top-1 agree':>12} {'perplexity':>11} "
          f"{'ppl vs f32':>11}")
    for name, r in rows:
        print(f"{name:<30} {r['kl']:>10.5f} {100 * r['top1']:>11.2f}% {r['ppl']:>11.3f} "
              f"{100 * (r['ppl'] / base['ppl'] - 1):>+10.2f}%")
    print(f"({time.perf_counter() - t0:.0f} s)")
    return 0
