"""Decode latency and batched throughput on random-weight models of real shapes (the GPU run).

    python benchmarks/real_shapes.py [--models smollm2,llama-1b,llama-8b] [--device cuda]
                                     [--dtype bfloat16] [--batch 64] [--json out.json]

Real weights cannot reach the lent GPU, and speed does not depend on the values, so each model
is a folder holding only a config.json of the real shape (../shared/README.md: SmolLM2-135M,
Llama-3.2-1B, Llama-3.1-8B) and a word-level tokenizer over its vocabulary, loaded with
`load_format="dummy"` (seeded random weights). Nothing is downloaded and no other package is
needed. Per model and engine mode:
- single stream: 128 prompt tokens, 128 generated: time to first token and decode ms per token
  (median step), with its ratio to the weight-read floor (weight bytes / --read-gbps);
- batch: --batch requests of 256 prompt + 128 generated tokens submitted at once: total
  tokens/s (the shape of the HF static-batching figures in ../shared/README.md).

Modes on CUDA: the default (the Triton backend, CUDA graphs, async scheduling), the same with
synchronous steps (--no-async-scheduling), the Triton backend eager (--enforce-eager), and with
--torch-eager the PyTorch backend eager (the oracle). On CPU (`--device cpu --models tiny`,
used by the tests) the default mode only.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from tokenmill.bench.shapes import SHAPES, write_model_folder

# the default (graphs, async scheduling: each step prepared while the one before runs), the
# same with synchronous steps (what the overlap buys), and eager (what graphs buy); the PyTorch
# backend (the oracle) with --torch-eager
MODES_CUDA = {"graphs + async (default)": {},
              "graphs, sync steps": {"async_scheduling": False},
              "triton eager": {"enforce_eager": True}}
TORCH_EAGER = {"torch eager": {"attention_backend": "torch", "enforce_eager": True}}


def single_stream(llm: Any, vocab: int, rng: random.Random) -> tuple[float, float]:
    """(time to first token s, median decode ms per token) of one request, timed as
    `tokenmill bench latency` times it (a cold prefill, then token by token)."""
    from tokenmill.bench.latency import run_tokenmill_once

    run = run_tokenmill_once(llm, [rng.randrange(3, vocab) for _ in range(128)], 128)
    return run["ttft_s"], statistics.median(run["itl_ms"])


def batched(llm: Any, vocab: int, rng: random.Random, batch: int) -> float:
    """Total tokens/s of `batch` requests of 256 prompt + 128 generated tokens."""
    from tokenmill import SamplingParams

    llm.reset_prefix_cache()
    prompts = [[rng.randrange(3, vocab) for _ in range(256)] for _ in range(batch)]
    params = SamplingParams(temperature=0, max_tokens=128, ignore_eos=True)
    t0 = time.perf_counter()
    llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return batch * (256 + 128) / (time.perf_counter() - t0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="smollm2,llama-1b,llama-8b")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--read-gbps", type=float, default=None,
                        help="memory read bandwidth for the floor (default: H100 HBM ~3,090 "
                             "GB/s on CUDA, this CPU's ~30 GB/s otherwise)")
    # default on CUDA 8 GiB, which hold the batch's 64 x 384 tokens of the 8B model (128 KiB a
    # token in bfloat16) without preemption; on CPU the engine's own default
    parser.add_argument("--kv-cache-memory", default=None)
    parser.add_argument("--torch-eager", action="store_true",
                        help="CUDA: also the PyTorch attention backend, eager")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()

    from tokenmill import LLM

    modes = ((MODES_CUDA | (TORCH_EAGER if args.torch_eager else {}))
             if args.device == "cuda" else {"default": {}})
    kv = args.kv_cache_memory or ("8GiB" if args.device == "cuda" else None)
    kv_memory = {"kv_cache_memory": kv} if kv else {}
    read_gbps = args.read_gbps or (3090.0 if args.device == "cuda" else 30.0)
    gpu = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    print(f"torch {torch.__version__}, device {gpu}, dtype {args.dtype}\n")
    print(f"{'model':<10} {'mode':<24} {'TTFT s':>8} {'decode ms/tok':>14} {'x floor':>8} "
          f"{'batch ' + str(args.batch) + ' tok/s':>16}")
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models.split(","):
            folder = write_model_folder(name, Path(tmp))
            vocab = SHAPES[name]["vocab_size"]
            for mode, options in modes.items():
                # max_num_seqs: graphs captured up to the batch only (a batch of 64 replays
                # the same size-64 graph either way; 11 captures instead of up to 51)
                llm = LLM(str(folder), load_format="dummy", device=args.device,
                          dtype=args.dtype, max_model_len=4096, max_num_seqs=args.batch,
                          **kv_memory, **options)
                weight_bytes = sum(p.numel() * p.element_size()
                                   for p in llm.engine.runner.model.parameters())
                floor_ms = weight_bytes / (read_gbps * 1e9) * 1e3
                single_stream(llm, vocab, random.Random(1))  # warm-up (compiles, caches)
                ttft, ms = single_stream(llm, vocab, random.Random(0))
                tps = batched(llm, vocab, random.Random(0), args.batch)
                results.append(dict(model=name, mode=mode, ttft_s=ttft, decode_ms=ms,
                                    floor_ms=floor_ms, batch=args.batch, total_tok_s=tps))
                print(f"{name:<10} {mode:<24} {ttft:>8.4f} {ms:>14.3f} {ms / floor_ms:>8.2f} "
                      f"{tps:>16.1f}", flush=True)
                del llm
                gc.collect()
                if args.device == "cuda":
                    torch.cuda.empty_cache()
    if args.json:
        Path(args.json).write_text(json.dumps(dict(device=gpu, dtype=args.dtype,
                                                   results=results), indent=2))


if __name__ == "__main__":
    main()
