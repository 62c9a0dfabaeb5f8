"""bf16 safetensors checkpoints of real model shapes (Llama-3.2-1B, Llama-3.1-8B) with random
weights, as a Hub model is stored (HF folder, shards of at most ~4.5 GB, config and tokenizer),
served by tokenmill: start (load) time, peak RSS and what it is (anonymous memory, or the
files' pages, just after loading), time to first token, single-stream decode and batch throughput.

The folder is written once under $TOKENMILL_CACHE_DIR/bench (the 8B: 16 GB on disk, ~3 min);
--folder serves one that exists. Each measurement is a child process of its own, and each
child first reads the weight files through the page cache (timed apart: a warm start, as the
second start of a downloaded model; the previous child's own memory may have pushed the files
out). --tree DIR also runs tokenmill from another checkout (PYTHONPATH=DIR: its kernels built
in DIR/tokenmill/_C), alternated with this one, for a before / after in one run.

    python benchmarks/bf16_checkpoint.py --shapes 8b --prompt-len 32 --decode-len 16 --batch 4
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from tokenmill.bench.child import ChildFailed, print_result, run_child
from tokenmill.bench.machine import describe_machine, process_memory_mib
from tokenmill.bench.shapes import SHAPES, write_model_folder

SHAPE_NAMES = {"1b": "llama-1b", "8b": "llama-8b"}
SHARD_BYTES = 4_500_000_000  # transformers' default max_shard_size ("5GB") in spirit


def _tensor_plan(shape: dict) -> list[tuple[str, tuple[int, ...]]]:
    """HF Llama's checkpoint tensors and their shapes."""
    h, inter, vocab = shape["hidden_size"], shape["intermediate_size"], shape["vocab_size"]
    kv = shape["num_key_value_heads"] * h // shape["num_attention_heads"]
    plan: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (vocab, h))]
    for i in range(shape["num_hidden_layers"]):
        p = f"model.layers.{i}."
        plan += [(p + "input_layernorm.weight", (h,)),
                 (p + "post_attention_layernorm.weight", (h,)),
                 (p + "self_attn.q_proj.weight", (h, h)), (p + "self_attn.k_proj.weight", (kv, h)),
                 (p + "self_attn.v_proj.weight", (kv, h)), (p + "self_attn.o_proj.weight", (h, h)),
                 (p + "mlp.gate_proj.weight", (inter, h)), (p + "mlp.up_proj.weight", (inter, h)),
                 (p + "mlp.down_proj.weight", (h, inter))]
    plan.append(("model.norm.weight", (h,)))
    if not shape.get("tie_word_embeddings"):
        plan.append(("lm_head.weight", (vocab, h)))
    return plan


def write_bf16_folder(name: str, out: Path) -> Path:
    """The shape's folder: config (torch_dtype bfloat16), tokenizer, N(0, 0.02) weights in
    bfloat16 shards with their index."""
    import torch
    from safetensors.torch import save_file

    folder = write_model_folder(name, out)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(config | {"torch_dtype": "bfloat16"}))
    gen = torch.Generator().manual_seed(0)
    shard: dict[str, torch.Tensor] = {}
    weight_map: dict[str, str] = {}
    total = 0

    def flush() -> None:
        file = f"model-{len(set(weight_map.values())) + 1:05d}.safetensors"
        save_file(shard, str(folder / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, file))
        shard.clear()

    for tensor_name, dims in _tensor_plan(SHAPES[name]):
        t = torch.ones(dims) if len(dims) == 1 else torch.randn(dims, generator=gen) * 0.02
        shard[tensor_name] = t.to(torch.bfloat16)
        total += shard[tensor_name].numel() * 2
        if sum(v.numel() * 2 for v in shard.values()) >= SHARD_BYTES:
            flush()
    if shard:
        flush()
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    return folder


def model_folder(shape: str, root: Path) -> Path:
    name = SHAPE_NAMES[shape]
    folder = root / f"{name}-bf16"
    if not (folder / name / "model.safetensors.index.json").is_file():
        write_bf16_folder(name, folder)
    return folder / name


def read_through(folder: Path) -> float:
    """Read the weight files (into the page cache); seconds taken."""
    t0 = time.perf_counter()
    for f in sorted(folder.glob("*.safetensors")):
        with open(f, "rb") as fh:
            while fh.read(64 << 20):
                pass
    return time.perf_counter() - t0


def measure(folder: str, prompt_len: int, decode_len: int, batch: int) -> dict:
    """One engine's figures (this function runs from this file under --tree too: only the
    tokenmill it imports differs)."""
    import numpy as np

    from tokenmill import LLM, SamplingParams
    from tokenmill.bench.latency import run_tokenmill_once

    rng = np.random.default_rng(1)
    vocab = json.loads((Path(folder) / "config.json").read_text())["vocab_size"]
    t0 = time.perf_counter()
    llm = LLM(folder, max_model_len=prompt_len + decode_len + 16)
    result = {"load_s": time.perf_counter() - t0,
              "anon_gib": process_memory_mib("RssAnon") / 1024,  # the process's own memory
              "file_gib": process_memory_mib("RssFile") / 1024}  # the files' pages it maps
    single = run_tokenmill_once(llm, rng.integers(3, vocab, prompt_len).tolist(), decode_len)
    params = SamplingParams(temperature=0, max_tokens=decode_len // 2, ignore_eos=True)
    prompts = [rng.integers(3, vocab, prompt_len).tolist() for _ in range(batch)]
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    tokens = sum(len(o.prompt_token_ids) + len(o.outputs[0].token_ids) for o in outs)
    return result | {"ttft_s": single["ttft_s"], "decode_tok_s": single["decode_tokens_per_s"],
                     "batch_tok_s": tokens / (time.perf_counter() - t0)}


def _child(args: argparse.Namespace) -> int:
    result = {"read_s": read_through(Path(args.child))}
    result |= measure(args.child, args.prompt_len, args.decode_len, args.batch)
    result["peak_rss_gib"] = process_memory_mib("VmHWM") / 1024
    print_result(result)
    return 0


def _measure(folder: Path, tree: str | None, args: argparse.Namespace) -> dict | None:
    # this file run as a script: under --tree its imports resolve to that checkout's package
    cmd = [sys.executable, os.path.abspath(__file__), "--child", str(folder),
           "--prompt-len", str(args.prompt_len), "--decode-len", str(args.decode_len),
           "--batch", str(args.batch)]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([tree or str(Path(__file__).parents[2]),
                                         env.get("PYTHONPATH", "")])
    try:
        return run_child(cmd, env)
    except ChildFailed as e:
        print(f"  failed\n{str(e)[-2000:]}")
        return None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default="1b,8b")
    p.add_argument("--folder", help="serve this HF folder instead of writing the shapes'")
    p.add_argument("--tree", help="also run the tokenmill checkout at this path, alternated")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--decode-len", type=int, default=64)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        return _child(args)
    from tokenmill.model_loader.gguf_cache import cache_root

    print(describe_machine())
    folders = [Path(args.folder)] if args.folder else \
        [model_folder(s, cache_root() / "bench") for s in args.shapes.split(",")]
    for folder in folders:
        size = sum(f.stat().st_size for f in folder.glob("*.safetensors"))
        print(f"\n{folder}: {size / 2**30:.2f} GiB of bf16 safetensors")
        for _ in range(args.rounds):
            for label, tree in [("this tree", None)] + ([(args.tree, args.tree)] if args.tree
                                                        else []):
                r = _measure(folder, tree, args)
                if r is None:
                    continue
                print(f"  {label:<24} read {r['read_s']:5.1f} s  load {r['load_s']:5.1f} s  "
                      f"peak RSS {r['peak_rss_gib']:5.2f} GiB (loaded: anon "
                      f"{r['anon_gib']:.2f}, file {r['file_gib']:.2f})  TTFT "
                      f"{r['ttft_s']:5.2f} s  decode "
                      f"{r['decode_tok_s']:6.2f} tok/s  batch-{args.batch} "
                      f"{r['batch_tok_s']:7.1f} tok/s", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
