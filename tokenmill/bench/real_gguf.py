"""GGUF files of real model shapes (Llama-3.2-1B, Llama-3.1-8B, and "moe": OLMoE-1B-7B's
sizes, 64 experts of 1024 with 8 used, in llama.cpp's Mixtral layout) with random weights,
served by tokenmill and, where llama-cpp-python is installed, by llama.cpp on the same files:
load time, peak RSS, time to first token, single-stream decode and batch-16 throughput.

How the files are made (cached under $TOKENMILL_CACHE_DIR/bench, printed):
- with llama-cpp-python: an F16 file written with `gguf` (N(0, 0.02) weights), quantized to
  Q4_K_M and Q8_0 by llama.cpp's own quantizer (`llama_model_quantize`);
- without it: the Q4_K_M file written directly, with llama.cpp's Q4_K_M type choice (Q6_K
  for attn_v and ffn_down in the first and last eighth of the layers and every third layer
  between, and for the output; Q4_K elsewhere) and random blocks of those types
  (speed does not depend on the values); Q8_0 quantized by the gguf package.
The tokenizer is SmolLM2's, padded with reserved tokens to the shape's 128256 entries.
Each engine is measured in a child process of its own (its peak RSS alone).

    python benchmarks/real_gguf.py --shapes 1b --types Q4_K_M
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np

from tokenmill.bench.child import ChildFailed, print_result, run_child
from tokenmill.bench.machine import describe_machine, process_memory_mib

SHAPES = {  # hidden, layers, heads, kv heads, intermediate (MoE: per expert), vocab, tied
    "1b": (2048, 16, 32, 8, 8192, 128256, True),
    "8b": (4096, 32, 32, 8, 14336, 128256, False),
    "moe": (2048, 16, 16, 16, 1024, 50304, False),
}
EXPERTS = {"moe": (64, 8)}  # experts, used per token


# Where the fp16 scales of each block type sit, and a scale that gives weights of about
# N(0, 0.02)'s magnitude (random_blocks)
_F16_FIELDS = {"Q5_0": {0: 2e-3}, "Q5_1": {0: 1e-3, 2: -16e-3}, "Q4_K": {0: 4e-5, 2: 4e-5},
               "Q5_K": {0: 2e-5, 2: 2e-5}, "Q6_K": {208: 1e-5}, "Q3_K": {108: 4e-4},
               "Q2_K": {80: 1e-3, 82: 1e-3}, "IQ4_XS": {0: 1e-5}, "IQ4_NL": {0: 2e-4}}
RANDOM_BLOCK_TYPES = tuple(_F16_FIELDS)


def random_blocks(type_name: str, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """(rows, bytes per row) uint8 of random `type_name` blocks: random quantized values and
    sub-block scales, fp16 scales drawn around _F16_FIELDS (the gguf package cannot quantize
    into K-quants; their arithmetic is the same for any values)."""
    import gguf

    qtype = gguf.GGMLQuantizationType[type_name]
    weights, nbytes = gguf.GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (rows, cols // weights, nbytes), dtype=np.uint8)
    for offset, scale in _F16_FIELDS[type_name].items():
        value = (rng.uniform(0.5, 1.5, (rows, cols // weights)) * scale).astype(np.float16)
        raw[:, :, offset:offset + 2] = value.view(np.uint8).reshape(rows, -1, 2)
    return raw.reshape(rows, -1)


def _more_bits(layer: int, layers: int) -> bool:
    """llama.cpp's use_more_bits: Q4_K_M's attn_v / ffn_down layers kept in Q6_K."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def _tensor_plan(shape: str) -> list[tuple[str, tuple[int, int]]]:
    h, n, heads, kv, inter, vocab, tied = SHAPES[shape]
    d = h // heads
    plan = [("token_embd.weight", (vocab, h))]
    for i in range(n):
        plan += [(f"blk.{i}.attn_q.weight", (h, h)), (f"blk.{i}.attn_k.weight", (kv * d, h)),
                 (f"blk.{i}.attn_v.weight", (kv * d, h)),
                 (f"blk.{i}.attn_output.weight", (h, h)),
                 (f"blk.{i}.attn_norm.weight", (h,)), (f"blk.{i}.ffn_norm.weight", (h,))]
        if shape in EXPERTS:  # stacked (E, rows, cols), the router beside them
            e = EXPERTS[shape][0]
            plan += [(f"blk.{i}.ffn_gate_inp.weight", (e, h)),
                     (f"blk.{i}.ffn_gate_exps.weight", (e, inter, h)),
                     (f"blk.{i}.ffn_up_exps.weight", (e, inter, h)),
                     (f"blk.{i}.ffn_down_exps.weight", (e, h, inter))]
        else:
            plan += [(f"blk.{i}.ffn_gate.weight", (inter, h)),
                     (f"blk.{i}.ffn_up.weight", (inter, h)),
                     (f"blk.{i}.ffn_down.weight", (h, inter))]
    plan.append(("output_norm.weight", (h,)))
    if not tied:
        plan.append(("output.weight", (vocab, h)))
    return plan


def _q4_k_m_type(name: str, layers: int) -> str:
    if name == "output.weight":
        return "Q6_K"
    if ".attn_v." in name or ".ffn_down" in name:
        return "Q6_K" if _more_bits(int(name.split(".")[1]), layers) else "Q4_K"
    return "Q4_K"


def _writer(path: Path, shape: str):
    import gguf

    from tokenmill.model_loader.default_model import default_model_path
    from tokenmill.model_loader.gguf_loader import gguf_reader

    h, n, heads, kv, inter, vocab, _ = SHAPES[shape]
    w = gguf.GGUFWriter(str(path), "llama")
    for key, value in (("context_length", 8192), ("embedding_length", h),
                       ("feed_forward_length", inter), ("block_count", n),
                       ("attention.head_count", heads), ("attention.head_count_kv", kv),
                       ("rope.dimension_count", h // heads), ("vocab_size", vocab)):
        w.add_uint32(f"llama.{key}", value)
    if shape in EXPERTS:
        w.add_uint32("llama.expert_count", EXPERTS[shape][0])
        w.add_uint32("llama.expert_used_count", EXPERTS[shape][1])
    w.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
    w.add_float32("llama.rope.freq_base", 500000.0)
    for name, field in gguf_reader(default_model_path()).fields.items():
        if not name.startswith("tokenizer."):
            continue
        value = field.contents()
        if name == "tokenizer.ggml.tokens":
            value = value + [f"<|reserved_{i}|>" for i in range(vocab - len(value))]
        elif name == "tokenizer.ggml.token_type":
            value = value + [1] * (vocab - len(value))  # plain entries (control ones would
            # be 79k added tokens, which transformers loads in seconds: not Llama 3's 256)
        sub = field.types[1] if len(field.types) > 1 else None
        w.add_key_value(name, value, field.types[0], sub)
    return w


def _write(path: Path, shape: str, kind: str) -> None:
    """kind: "F16", "Q8_0" (gguf-quantized) or "Q4_K_M" (random blocks): module doc."""
    import gguf

    rng = np.random.default_rng(0)
    w = _writer(path, shape)
    layers = SHAPES[shape][1]
    for name, dims in _tensor_plan(shape):
        if len(dims) == 1:
            w.add_tensor(name, np.ones(dims, np.float32))
            continue
        if kind == "Q4_K_M":
            t = _q4_k_m_type(name, layers)
            raw = np.stack([random_blocks(t, *dims[-2:], seed=len(name) + e)
                            for e in range(dims[0] if len(dims) == 3 else 1)])
            w.add_tensor(name, raw if len(dims) == 3 else raw[0],
                         raw_dtype=gguf.GGMLQuantizationType[t])
            continue
        data = (rng.standard_normal(dims, np.float32) * 0.02)
        if kind == "F16":
            w.add_tensor(name, data.astype(np.float16))
        else:
            w.add_tensor(name, gguf.quants.quantize(data, gguf.GGMLQuantizationType.Q8_0),
                         raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file(progress=True)
    w.close()


def model_file(shape: str, kind: str, folder: Path) -> tuple[Path, str]:
    """The file of `shape` in `kind` ("Q4_K_M", "Q8_0") and how it was made."""
    path = folder / f"llama-{shape}-{kind}.gguf"
    try:
        import llama_cpp
    except ImportError:
        llama_cpp = None
    how = "llama.cpp's quantizer" if llama_cpp else ("random blocks" if kind == "Q4_K_M"
                                                      else "gguf's quantizer")
    if path.is_file():
        return path, how
    folder.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    if llama_cpp is None:
        _write(tmp, shape, kind)
    else:
        f16 = folder / f"llama-{shape}-F16.gguf"
        if not f16.is_file():
            _write(f16, shape, "F16")
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{kind}")
        if llama_cpp.llama_model_quantize(str(f16).encode(), str(tmp).encode(), params):
            raise RuntimeError(f"llama.cpp could not quantize {f16} to {kind}")
    os.replace(tmp, path)
    return path, how


def _prompts(n: int, length: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 49152, length).tolist() for _ in range(n)]


def measure_tokenmill(path: str, prompt_len: int, decode_len: int, batch: int,
                      int8_activations: bool = False) -> dict:
    from tokenmill import LLM, SamplingParams
    from tokenmill.bench.latency import run_tokenmill_once

    t0 = time.perf_counter()
    llm = LLM(path, max_model_len=prompt_len + decode_len + 16,
              int8_activations=int8_activations)
    load = time.perf_counter() - t0
    single = run_tokenmill_once(llm, _prompts(1, prompt_len, 1)[0], decode_len)
    params = SamplingParams(temperature=0, max_tokens=decode_len // 2, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate(_prompts(batch, prompt_len, 2), params, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    tokens = sum(len(o.prompt_token_ids) + len(o.outputs[0].token_ids) for o in outs)
    return {"load_s": load, "ttft_s": single["ttft_s"],
            "decode_tok_s": single["decode_tokens_per_s"], "batch_tok_s": tokens / elapsed,
            "quantization": llm.engine.config.model.quantization}


def measure_llama_cpp(path: str, prompt_len: int, decode_len: int, batch: int) -> dict:
    from llama_cpp import Llama

    from tokenmill.bench.latency import run_llama_cpp_once

    t0 = time.perf_counter()
    llm = Llama(path, n_ctx=prompt_len + decode_len + 16, n_threads=os.cpu_count(),
                n_batch=512, verbose=False)
    load = time.perf_counter() - t0
    single = run_llama_cpp_once(llm, _prompts(1, prompt_len, 1)[0], decode_len)
    t0 = time.perf_counter()
    tokens = 0
    for prompt in _prompts(batch, prompt_len, 2):  # one sequence at a time: its server's
        llm.reset()                                 # batching is not in the Python API
        out = llm.generate(prompt, temp=0.0, reset=True)
        tokens += len(prompt) + sum(1 for _, _ in zip(range(decode_len // 2), out,
                                                      strict=False))
    return {"load_s": load, "ttft_s": single["ttft_s"],
            "decode_tok_s": single["decode_tokens_per_s"],
            "batch_tok_s": tokens / (time.perf_counter() - t0)}


def _run_child(path: Path, engine: str, args: argparse.Namespace) -> dict | None:
    cmd = [sys.executable, "-m", "tokenmill.bench.real_gguf", "--child", str(path),
           "--engine", engine, "--prompt-len", str(args.prompt_len),
           "--decode-len", str(args.decode_len), "--batch", str(args.batch)]
    try:
        return run_child(cmd)
    except ChildFailed as e:
        print(f"  {engine}: failed\n{str(e)[-2000:]}")
        return None


def _child(args: argparse.Namespace) -> int:
    if args.engine == "prepare":  # start once (the conversion), measure nothing else
        from tokenmill import LLM

        t0 = time.perf_counter()
        LLM(args.child, max_model_len=args.prompt_len + args.decode_len + 16)
        print_result({"load_s": time.perf_counter() - t0})
        return 0
    if args.engine == "llama.cpp":
        result = measure_llama_cpp(args.child, args.prompt_len, args.decode_len, args.batch)
    else:  # tokenmill, or tokenmill-int8 (int8_activations=True)
        result = measure_tokenmill(args.child, args.prompt_len, args.decode_len, args.batch,
                                   args.engine == "tokenmill-int8")
    result["peak_rss_gib"] = process_memory_mib("VmHWM") / 1024
    print_result(result)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default="1b,8b")
    p.add_argument("--types", default="Q4_K_M,Q8_0")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--decode-len", type=int, default=64)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--int8-activations", action="store_true",
                   help="also serve each file with int8_activations=True (K-quants, Q8_0, Q4_x)")
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--engine", default="tokenmill", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        return _child(args)
    from tokenmill.model_loader.gguf_cache import cache_root

    print(describe_machine())
    engines = ["tokenmill"] + (["tokenmill-int8"] if args.int8_activations else [])
    try:
        import llama_cpp  # noqa: F401
        engines.append("llama.cpp")
    except ImportError:
        print("note: llama-cpp-python is not installed: tokenmill only")
    for shape in args.shapes.split(","):
        for kind in args.types.split(","):
            path, how = model_file(shape, kind, cache_root() / "bench")
            print(f"\n{shape} {kind} ({how}): {path.stat().st_size / 2**30:.2f} GiB")
            for engine in engines:
                first = None
                if engine == "tokenmill":  # the first start converts the file once: timed
                    first = _run_child(path, "prepare", args)  # apart, not measured again
                r = _run_child(path, engine, args)
                if r is None:
                    continue
                print(f"  {engine:14s} load {r['load_s']:5.1f} s"
                      + (f" (first start {first['load_s']:.1f} s)" if first else "")
                      + f"  peak RSS {r['peak_rss_gib']:5.2f} GiB  TTFT {r['ttft_s']:6.2f} s"
                      f"  decode {r['decode_tok_s']:6.2f} tok/s  batch-{args.batch} "
                      f"{r['batch_tok_s']:7.1f} tok/s"
                      + (f"  ({r['quantization']})" if 'quantization' in r else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
