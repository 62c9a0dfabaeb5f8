"""Sliding-window attention: the KV memory a long generation holds, and its decode speed, with
a window in every layer (Mistral's) against the same model with full attention.

    python benchmarks/sliding_window.py [--window 256] [--prompt 512] [--tokens 1536]
                                        [--requests 8] [--rounds 2]

A random-weight Mistral of SmolLM2's shape (hidden 576, 30 layers, 9 heads / 3 KV heads,
SmolLM2's tokenizer; load_format="dummy"), block size 16. Two engines, identical but for
`sliding_window` (None: full attention); rounds alternate them. Each round generates
--tokens greedy tokens for --requests requests of a --prompt-token prompt, all at once;
"peak blocks" is the most KV blocks the requests held at once (core/kv_cache_manager.py
frees the blocks behind every layer's window), "decode tok/s" the generated tokens over the
run's wall time. Both use the CPU attention backend (its kernel starts each query at its
window).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def write_model(folder: str, window: int | None) -> None:
    from transformers import MistralConfig

    from tokenmill.engine.tokenizer import gguf_tokenizer
    from tokenmill.model_loader.default_model import default_model_path

    cfg = MistralConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                        num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                        max_position_embeddings=8192, rms_norm_eps=1e-5, bos_token_id=1,
                        eos_token_id=2, sliding_window=window, tie_word_embeddings=True)
    cfg.architectures = ["MistralForCausalLM"]
    cfg.save_pretrained(folder)
    gguf_tokenizer(default_model_path()).save_pretrained(folder)


def run(llm, prompts: list[list[int]], tokens: int) -> tuple[float, int, list[list[int]]]:
    """(decode tokens/s, peak KV blocks held, outputs)."""
    from tokenmill import SamplingParams

    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{time.monotonic_ns()}-{i}", p, params)
    peak, outs = 0, {}
    t0 = time.perf_counter()
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                outs[o.request_id] = o.outputs[0].token_ids
        peak = max(peak, engine.kv.num_usable_blocks - engine.kv.pool.num_free_blocks)
    elapsed = time.perf_counter() - t0
    return len(prompts) * tokens / elapsed, peak, [outs[k] for k in sorted(outs)]


def main() -> None:
    from tokenmill import LLM
    from tokenmill.bench.machine import describe_machine

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--window", type=int, default=256)
    p.add_argument("--prompt", type=int, default=512)
    p.add_argument("--tokens", type=int, default=1536)
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    print(describe_machine())
    prompts = [[100 + 13 * i + j for j in range(args.prompt)] for i in range(args.requests)]
    results: dict[str, dict[str, list[float]]] = {}
    with tempfile.TemporaryDirectory() as root:
        engines = {}
        for name, window in (("full attention", None), (f"window {args.window}", args.window)):
            folder = os.path.join(root, name.replace(" ", "_"))
            write_model(folder, window)
            # no prefix caching: freed blocks go back to the pool, not to the tree
            engines[name] = LLM(folder, load_format="dummy", kv_cache_memory="2GiB",
                                enable_prefix_caching=False)
            results[name] = {"tok/s": [], "peak blocks": []}
        for r in range(args.rounds + 1):  # round 0 warms up
            for name, llm in engines.items():
                rate, peak, _ = run(llm, prompts if r else prompts[:1],
                                    args.tokens if r else 16)
                if r:
                    results[name]["tok/s"].append(rate)
                    results[name]["peak blocks"].append(peak)
        backends = {name: type(llm.engine.runner.backend).__name__
                    for name, llm in engines.items()}
        for llm in engines.values():
            llm.engine.shutdown()
    print(f"\nMistral of SmolLM2's shape, 30 layers, random weights, float32; {args.requests} "
          f"requests x ({args.prompt} prompt + {args.tokens} generated) tokens, all at once; "
          f"block size 16; median of {args.rounds} alternated rounds")
    print(f"{'attention':>16}{'peak blocks':>13}{'peak KV MiB':>13}{'decode tok/s':>14}"
          f"  backend")
    block_mib = 2 * 30 * 16 * 3 * 64 * 4 / 2**20  # K and V, 30 layers, 16 tokens, 3 x 64 f32
    for name, res in results.items():
        peak = max(res["peak blocks"])
        print(f"{name:>16}{peak:>13}{peak * block_mib:>13.1f}"
              f"{statistics.median(res['tok/s']):>14.1f}  {backends[name]}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
