"""Mixture of experts: decode tokens/s of the grouped expert path against HF's per-expert loop.

    python benchmarks/moe.py [--experts 8] [--top-k 2] [--intermediate 384] [--layers 30]
                             [--batches 1,16,64] [--tokens 64] [--rounds 3]

A random-weight Mixtral of SmolLM2's width (hidden 576, 9 heads / 3 KV heads, 49,152 tokens,
SmolLM2's tokenizer), tiny experts (8 x 384 intermediate features, top-2) and 30 layers,
loaded with load_format="dummy". One engine; per batch size, rounds alternate the grouped path
(layers/fused_moe.py: the pairs sorted by expert once, one GEMM pair per active expert) and the
masked loop Hugging Face's Mixtral runs (a one-hot mask and a `where` per expert); each round
decodes `--tokens` tokens per request after a 32-token prompt, greedy. Tokens/s counts the
decoded tokens over the wall time of the generate call; the greedy outputs of the two paths
are checked equal. A second engine with quantization="int8" (every weight in Q8_0 blocks, the
experts' one block set per expert: quantization/moe.py) runs the grouped path in the same
alternation, the "int8" column.
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


def write_model(folder: str, experts: int, top_k: int, intermediate: int, layers: int) -> None:
    """config.json of the Mixtral and SmolLM2's tokenizer (weights: load_format="dummy")."""
    from transformers import AutoTokenizer, MixtralConfig

    from tokenmill.model_loader.default_model import default_model_path

    cfg = MixtralConfig(vocab_size=49152, hidden_size=576, intermediate_size=intermediate,
                        num_hidden_layers=layers, num_attention_heads=9, num_key_value_heads=3,
                        max_position_embeddings=2048, rms_norm_eps=1e-5, bos_token_id=1,
                        eos_token_id=2, num_local_experts=experts, num_experts_per_tok=top_k,
                        sliding_window=None, tie_word_embeddings=True)
    cfg.architectures = ["MixtralForCausalLM"]
    cfg.save_pretrained(folder)
    gguf = default_model_path()
    AutoTokenizer.from_pretrained(os.path.dirname(gguf),
                                  gguf_file=os.path.basename(gguf)).save_pretrained(folder)


def main() -> None:
    from tokenmill import LLM, SamplingParams
    from tokenmill.bench.machine import describe_machine
    from tokenmill.layers.fused_moe import FusedMoE

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--intermediate", type=int, default=384)
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--batches", default="1,16,64")
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    print(describe_machine())
    with tempfile.TemporaryDirectory() as folder:
        write_model(folder, args.experts, args.top_k, args.intermediate, args.layers)
        llm = LLM(folder, load_format="dummy", kv_cache_memory="1GiB")
        int8 = LLM(folder, load_format="dummy", kv_cache_memory="1GiB", quantization="int8")
        params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
        paths = ("grouped", "masked loop", "int8")
        results: dict[str, dict[int, list[float]]] = {path: {} for path in paths}
        same = True
        for batch in (int(b) for b in args.batches.split(",")):
            prompts = [[100 + 7 * i + j for j in range(32)] for i in range(batch)]
            outputs = {}
            for r in range(args.rounds + 1):  # round 0 warms up
                for path in paths:
                    FusedMoE.grouped = path != "masked loop"
                    t0 = time.perf_counter()
                    outs = (int8 if path == "int8" else llm).generate(prompts, params,
                                                                      use_tqdm=False)
                    rate = batch * args.tokens / (time.perf_counter() - t0)
                    if r:
                        results[path].setdefault(batch, []).append(rate)
                    outputs[path] = [o.outputs[0].token_ids for o in outs]
            same &= outputs["grouped"] == outputs["masked loop"]
        FusedMoE.grouped = True
        llm.engine.shutdown()
        int8.engine.shutdown()
    print(f"\nMixtral of SmolLM2's width: {args.layers} layers, {args.experts} experts x "
          f"{args.intermediate} intermediate, top-{args.top_k}, float32, random weights; "
          f"decode tokens/s after a 32-token prompt, {args.tokens} tokens per request, median "
          f"of {args.rounds} alternated rounds")
    print(f"{'batch':>6}{'grouped':>12}{'masked loop':>14}{'grouped / loop':>16}"
          f"{'int8':>10}{'int8 / grouped':>16}")
    for batch in results["grouped"]:
        g, m, q = (statistics.median(results[path][batch]) for path in paths)
        print(f"{batch:>6}{g:>12.1f}{m:>14.1f}{g / m:>16.2f}{q:>10.1f}{q / g:>16.2f}")
    print(f"greedy outputs identical across the two paths: {same}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
