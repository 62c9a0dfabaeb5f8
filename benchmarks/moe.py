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

With `--device cuda` (the lent GPU; `--tokenizer DIR` where the model package is absent) the
paths are the Triton fused-MoE kernel (layers/fused_moe_triton.py: two grouped GEMM launches
per layer), the grouped PyTorch path and the masked loop, in the engine's CUDA dtype (bfloat16
unless --dtype says otherwise); int8 is a CPU method and is not run there.
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


def write_model(folder: str, experts: int, top_k: int, intermediate: int, layers: int,
                tokenizer: str | None = None) -> None:
    """config.json of the Mixtral and SmolLM2's tokenizer (weights: load_format="dummy"), from
    the model package or from the folder `tokenizer`."""
    from transformers import AutoTokenizer, MixtralConfig

    from tokenmill.engine.tokenizer import gguf_tokenizer
    from tokenmill.model_loader.default_model import default_model_path

    cfg = MixtralConfig(vocab_size=49152, hidden_size=576, intermediate_size=intermediate,
                        num_hidden_layers=layers, num_attention_heads=9, num_key_value_heads=3,
                        max_position_embeddings=2048, rms_norm_eps=1e-5, bos_token_id=1,
                        eos_token_id=2, num_local_experts=experts, num_experts_per_tok=top_k,
                        sliding_window=None, tie_word_embeddings=True)
    cfg.architectures = ["MixtralForCausalLM"]
    cfg.save_pretrained(folder)
    tok = (AutoTokenizer.from_pretrained(tokenizer) if tokenizer is not None
           else gguf_tokenizer(default_model_path()))
    tok.save_pretrained(folder)


def main() -> None:
    import torch

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
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--dtype", default="auto")
    p.add_argument("--tokenizer", default=None,
                   help="a folder holding SmolLM2's tokenizer (default: the model package's)")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    cuda = args.device == "cuda"
    print(torch.cuda.get_device_name() if cuda else describe_machine())
    # each path: which engine, FusedMoE.grouped and FusedMoE.use_triton (set per round below)
    paths = (("triton fused", "grouped", "masked loop") if cuda
             else ("grouped", "masked loop", "int8"))
    with tempfile.TemporaryDirectory() as folder:
        write_model(folder, args.experts, args.top_k, args.intermediate, args.layers,
                    args.tokenizer)
        engine = dict(load_format="dummy", kv_cache_memory="1GiB", device=args.device,
                      dtype=args.dtype)
        llm = LLM(folder, **engine)
        int8 = None if cuda else LLM(folder, quantization="int8", **engine)
        dtype = llm.engine.config.model.dtype
        params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
        results: dict[str, dict[int, list[float]]] = {path: {} for path in paths}
        same = True
        for batch in (int(b) for b in args.batches.split(",")):
            prompts = [[100 + 7 * i + j for j in range(32)] for i in range(batch)]
            outputs = {}
            for r in range(args.rounds + 1):  # round 0 warms up
                for path in paths:
                    FusedMoE.grouped = path != "masked loop"
                    FusedMoE.use_triton = path == "triton fused" if cuda else None
                    t0 = time.perf_counter()
                    outs = (int8 if path == "int8" else llm).generate(prompts, params,
                                                                      use_tqdm=False)
                    rate = batch * args.tokens / (time.perf_counter() - t0)
                    if r:
                        results[path].setdefault(batch, []).append(rate)
                    outputs[path] = [o.outputs[0].token_ids for o in outs]
            same &= all(outputs[path] == outputs["masked loop"] for path in paths
                        if path != "int8")
        FusedMoE.grouped, FusedMoE.use_triton = True, None
        llm.engine.shutdown()
        if int8 is not None:
            int8.engine.shutdown()
    print(f"\nMixtral of SmolLM2's width: {args.layers} layers, {args.experts} experts x "
          f"{args.intermediate} intermediate, top-{args.top_k}, {str(dtype)[6:]}, random "
          f"weights, {args.device}; decode tokens/s after a 32-token prompt, {args.tokens} "
          f"tokens per request, median of {args.rounds} alternated rounds")
    others = [path for path in paths if path != "masked loop"]
    print(f"{'batch':>6}" + "".join(f"{path:>14}" for path in paths)
          + "".join(f"{path + ' / loop':>22}" for path in others))
    for batch in results[paths[0]]:
        rate = {path: statistics.median(results[path][batch]) for path in paths}
        print(f"{batch:>6}" + "".join(f"{rate[path]:>14.1f}" for path in paths)
              + "".join(f"{rate[path] / rate['masked loop']:>22.2f}" for path in others))
    print(f"greedy outputs identical across {', '.join(p for p in paths if p != 'int8')}: "
          f"{same}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
