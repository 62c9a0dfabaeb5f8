"""Multi-LoRA serving: decode tokens/s of a batch spread over 1, 4 and 16 adapters against the
same batch on the base model, and single-stream decode with and without an adapter.

    python benchmarks/lora.py [--model PATH] [--ranks 8,64] [--adapters 1,4,16]
                              [--lora-dtypes float32,bfloat16] [--batch 32]
                              [--prompt-len 32] [--tokens 64] [--single-tokens 256]
                              [--rounds 2]

The model is SmolLM2-135M-Instruct (the default GGUF file, its Q4_1 weights) unless --model
names another. Adapters are written as peft folders (adapter_config.json and
adapter_model.safetensors) with random A and B of the model's shapes on all seven projections
(q, k, v, o, gate, up, down), `--adapters` max of each rank, saved in float32. Engines: the
base model, and the model with enable_lora (max_loras = the largest adapter count,
max_lora_rank = the largest rank) for each `--lora-dtypes` entry (the slots' dtype: bfloat16
rounds the adapters, half the bytes each step reads). Rounds alternate every case, so that
drift hits them alike; each case generates `--tokens` tokens per request (single stream:
`--single-tokens`, so that a run lasts more than a moment), greedy, ignoring EOS, after a
`--prompt-len`-token prompt, and tokens/s counts the generated tokens over the wall time of
the generate call. "base, LoRA engine" is base requests on the LoRA engine: what enabling
adapters costs a request that uses none.
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

TARGETS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


def write_adapter(folder: str, hf_config, rank: int, seed: int) -> None:
    """A peft LoRA folder of random A (rank, in) and B (out, rank) on every projection."""
    import torch
    from safetensors.torch import save_file

    from tokenmill.lora.targets import target_shapes

    g = torch.Generator().manual_seed(seed)
    shapes = target_shapes(hf_config)
    tensors = {}
    for layer in range(hf_config.num_hidden_layers):
        for target in TARGETS:
            n_in, n_out = shapes[target]
            name = f"base_model.model.model.layers.{layer}.{target}"
            tensors[f"{name}.lora_A.weight"] = torch.randn(rank, n_in, generator=g) / n_in ** .5
            tensors[f"{name}.lora_B.weight"] = torch.randn(n_out, rank, generator=g) * 0.01
    os.makedirs(folder, exist_ok=True)
    save_file(tensors, os.path.join(folder, "adapter_model.safetensors"))
    with open(os.path.join(folder, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "r": rank, "lora_alpha": rank,
                   "target_modules": [t.split(".")[-1] for t in TARGETS]}, f)


def run_case(llm, prompts, loras, tokens: int) -> float:
    from tokenmill import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False, lora_request=loras)
    elapsed = time.perf_counter() - start
    return sum(len(o.outputs[0].token_ids) for o in outs) / elapsed


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None)
    p.add_argument("--ranks", default="8,64")
    p.add_argument("--adapters", default="1,4,16")
    p.add_argument("--lora-dtypes", default="float32,bfloat16")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--single-tokens", type=int, default=256,
                   help="tokens of each single-stream run (a short one is mostly noise)")
    p.add_argument("--rounds", type=int, default=2)
    return p.parse_args()


def write_adapters(root: str, hf_config, ranks: list[int], count: int) -> dict:
    """(rank, i) → a LoRARequest of a random adapter written under `root`."""
    from tokenmill import LoRARequest

    adapters = {}
    for rank in ranks:
        for i in range(count):
            folder = os.path.join(root, f"r{rank}-{i}")
            write_adapter(folder, hf_config, rank, seed=1000 * rank + i)
            adapters[rank, i] = LoRARequest(f"r{rank}-{i}", len(adapters) + 1, folder)
    return adapters


def make_cases(args: argparse.Namespace, base, lora_llms: dict, adapters: dict,
               prompts: list[list[int]], ranks: list[int], counts: list[int]) -> dict:
    """name → (engine, prompts, lora requests or None), in the order rounds run them."""
    cases = {f"batch {args.batch}, base": (base, prompts, None),
             "single stream, base": (base, prompts[:1], None)}
    for dt, lora_llm in lora_llms.items():
        cases[f"batch {args.batch}, base, LoRA engine ({dt})"] = (lora_llm, prompts, None)
        for rank in ranks:
            for n in counts:
                loras = [adapters[rank, i % n] for i in range(args.batch)]
                cases[f"batch {args.batch}, {n} adapters, rank {rank} ({dt})"] = (
                    lora_llm, prompts, loras)
        cases[f"single stream, base, LoRA engine ({dt})"] = (lora_llm, prompts[:1], None)
        for rank in ranks:
            cases[f"single stream, 1 adapter, rank {rank} ({dt})"] = (
                lora_llm, prompts[:1], [adapters[rank, 0]])
    return cases


def main() -> int:
    args = parse_args()
    from tokenmill import LLM
    from tokenmill.bench.machine import describe_machine
    from tokenmill.model_loader.default_model import default_model_path

    print(describe_machine())
    model = args.model or default_model_path()
    ranks = [int(r) for r in args.ranks.split(",")]
    counts = [int(c) for c in args.adapters.split(",")]
    base = LLM(model)
    lora_llms = {dt: LLM(model, enable_lora=True, max_loras=max(counts),
                         max_lora_rank=max(ranks), max_cpu_loras=max(counts) * len(ranks),
                         lora_dtype=dt) for dt in args.lora_dtypes.split(",")}
    hf_config = base.engine.config.model.hf_config
    vocab = hf_config.vocab_size
    prompts = [[(97 * r + 13 * j) % (vocab - 200) + 100 for j in range(args.prompt_len)]
               for r in range(args.batch)]
    print(f"model {model}: {hf_config.num_hidden_layers} layers, hidden "
          f"{hf_config.hidden_size}; batch {args.batch}, prompt {args.prompt_len}, "
          f"{args.tokens} tokens each (single stream {args.single_tokens}); adapters on all 7 "
          "projections")
    # the adapters (GBs for large models and ranks) are removed when the run ends
    with tempfile.TemporaryDirectory(prefix="tm-lora-bench-") as root:
        adapters = write_adapters(root, hf_config, ranks, max(counts))
        cases = make_cases(args, base, lora_llms, adapters, prompts, ranks, counts)
        for llm, ps, loras in cases.values():  # warm-up: adapters read, kernels built
            run_case(llm, ps, loras, 4)
        results: dict[str, list[float]] = {name: [] for name in cases}
        for _ in range(args.rounds):
            for name, (llm, ps, loras) in cases.items():
                tokens = args.single_tokens if name.startswith("single") else args.tokens
                results[name].append(run_case(llm, ps, loras, tokens))
    print(f"\n{'case':<56}{'tok/s':>10}{'vs base':>10}")
    for name, values in sorted(results.items(), key=lambda kv: kv[0].startswith("single")):
        tps = statistics.median(values)
        ref = statistics.median(results["single stream, base" if name.startswith("single")
                                        else f"batch {args.batch}, base"])
        print(f"{name:<56}{tps:>10.1f}{tps / ref:>9.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
