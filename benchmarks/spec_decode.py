"""Speculative decoding against none, single stream on SmolLM2, in one run: decode tokens/s,
acceptance, and whether greedy output stayed the same.

    python benchmarks/spec_decode.py [--rounds 2] [--max-tokens 128] [--quantization gguf]
                                     [--speculative-config JSON ...] [--batch64]
                                     [--target offgrid]

Each --speculative-config (repeatable; default n-gram) is one engine beside the one without.
A suffix proposer's cache of earlier outputs is emptied before each timed request (the rounds
repeat prompts); a `repeat` section then times a prompt asked a second time, with the cache.
--target offgrid serves, in float32, a copy of the GGUF file's weights each moved within half a
quantization step (bench/gguf_f32.py): a float checkpoint of which the file is a faithful
quantization, as a real full-precision model is (SmolLM2's float32 weights are otherwise its
Q4_1 blocks expanded, which its own 4-bit copy reproduces exactly and so flatters a quantized
self-draft); a draft_model config without "model" then drafts with the GGUF file itself.

Workloads (chat-templated, greedy, built at run time from text on the machine):
- repetitive: edits and rewrites that quote their input (source code and docstrings of the
  standard library), where the answer repeats much of the prompt;
- chat: general questions; stories: open-ended stories (little to look up).
Each prompt runs once per engine per round, engines alternating (the machine drifts); decode
tokens/s = (output tokens - 1) / (time of the full request - time of the same request cut to
one token), medians over rounds, summed over a workload's prompts. --batch64 also runs the
`uniform` workload (64 requests at once) through both engines: speculation must not slow it.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import shlex
import statistics
import sys
import textwrap
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tokenmill import LLM, SamplingParams  # noqa: E402
from tokenmill.bench.gguf_f32 import f32_copy  # noqa: E402
from tokenmill.bench.machine import describe_machine  # noqa: E402
from tokenmill.bench.workloads import make_workload  # noqa: E402
from tokenmill.model_loader.default_model import default_model_path  # noqa: E402
from tokenmill.spec_decode import SuffixProposer  # noqa: E402

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4,
         "prompt_lookup_min": 2}


def workloads() -> dict[str, list[str]]:
    code = [inspect.getsource(f) for f in (textwrap.dedent, shlex.quote, textwrap.indent)]
    docs = [inspect.getdoc(m)[:700] for m in (json, argparse)]
    return {
        "repetitive": [
            f"Rename the function in this code to `strip_indent` and return the whole code:\n"
            f"```python\n{code[0]}```",
            f"Add type hints to this function and return it in full:\n```python\n{code[1]}```",
            f"Rewrite this text with every sentence on its own line:\n\n{docs[0]}",
            f"Copy this code, adding a comment above each line:\n```python\n{code[2]}```",
            f"Fix any typos in the following text and return it unchanged otherwise:\n\n{docs[1]}",
        ],
        "chat": ["What are the benefits of regular exercise?", "Explain how a hash table works.",
                 "Give me three tips for learning a new language.",
                 "How do I make a good cup of tea?"],
        "stories": ["Write a short story about a dragon who learns to cook.",
                    "Tell me a story about a lighthouse keeper and a storm.",
                    "Write a fairy tale about a clever fox."],
    }


TEMPERATURE = 0.0  # --temperature: sampled requests (seeded) instead of greedy ones


def timed(llm: LLM, prompt: list[int], max_tokens: int,
          keep_cache: bool = False) -> tuple[float, list[int]]:
    """Seconds and output of one greedy request. A suffix proposer's cache of earlier outputs
    is emptied first unless `keep_cache`: the rounds repeat each prompt, and its own earlier
    answer would otherwise be drafted from (the `repeat` section measures that case)."""
    proposer = llm.engine.scheduler.proposer
    if isinstance(proposer, SuffixProposer) and not keep_cache:
        proposer.clear()
    params = SamplingParams(temperature=TEMPERATURE, max_tokens=max_tokens, seed=0)
    start = time.perf_counter()
    out = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0].outputs[0]
    return time.perf_counter() - start, out.token_ids


def timed_llama_cpp(peer, prompt: list[int], n: int) -> float:
    """Seconds for llama.cpp to make n greedy tokens after `prompt` (its KV reset first)."""
    peer.reset()
    start = time.perf_counter()
    for i, _ in enumerate(peer.generate(prompt, temp=0.0, reset=True)):
        if i + 1 == n:
            break
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--quantization", default=None, help="both engines' weights (default: "
                    "the model's default format)")
    ap.add_argument("--speculative-config", action="append", default=None)
    ap.add_argument("--target", choices=["default", "offgrid"], default="default")
    ap.add_argument("--batch64", action="store_true")
    ap.add_argument("--workloads", default="repetitive,chat,stories",
                    help="single-stream workloads to run (comma-separated; '' for none)")
    ap.add_argument("--kv-cache-memory", default=None, help="every engine's KV budget (a "
                    "draft model's KV shares it: give it room for both at batch 64)")
    ap.add_argument("--llama-cpp", action="store_true",
                    help="also llama.cpp (llama-cpp-python) on the GGUF file, greedy, the same "
                         "prompts and as many tokens as the engine without speculation made")
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="sample (seeded) at this temperature instead of greedy decoding; the "
                         "output then differs with speculation (its random draws do)")
    args = ap.parse_args()
    global TEMPERATURE
    TEMPERATURE = args.temperature
    specs = [json.loads(c) for c in args.speculative_config or [json.dumps(NGRAM)]]
    target, quantization = None, args.quantization
    if args.target == "offgrid":
        gguf_file = default_model_path()
        target, quantization = f32_copy(gguf_file, perturb_seed=0), "none"
        specs = [s | {"model": gguf_file} if s["method"] == "draft_model" and "model" not in s
                 else s for s in specs]
    engines = {"none": LLM(target, quantization=quantization,
                           kv_cache_memory=args.kv_cache_memory)}
    for spec in specs:
        label = spec["method"].replace("draft_model", "draft")
        if "quantization" in spec:
            label += f":{spec['quantization']}"
        engines[label] = LLM(target, quantization=quantization, speculative_config=spec,
                             kv_cache_memory=args.kv_cache_memory)
    tok = engines["none"].get_tokenizer()
    print(describe_machine())
    weights = engines["none"].engine.config.model.quantization or "float32"
    print(f"SmolLM2-135M-Instruct{' off-grid copy' if target else ''}, weights {weights}, "
          f"{f'temperature {TEMPERATURE}' if TEMPERATURE else 'greedy'}, max_tokens "
          f"{args.max_tokens}, {args.rounds} rounds")
    for label, spec in zip(list(engines)[1:], specs, strict=True):
        print(f"  {label}: {json.dumps(spec)}")
    peer = None
    if args.llama_cpp:
        from tokenmill.bench.latency import load_llama_cpp

        peer = load_llama_cpp(default_model_path(), torch.get_num_threads(), f32=False)
    print(f"\n{'workload':<12}{'engine':<12}{'decode tok/s':>13}{'speed-up':>10}{'accepted':>10}"
          f"{'tokens/verify':>15}{'same output':>13}")
    chosen = [w for w in args.workloads.split(",") if w]
    for name, texts in [(w, workloads()[w]) for w in chosen]:
        prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": t}],
                                                      tokenize=False, add_generation_prompt=True),
                              add_special_tokens=False) for t in texts]
        rates: dict[str, float] = {}
        outputs: dict[str, list[list[int]]] = {}
        for label, llm in engines.items():
            before = llm.engine.stats()
            secs, toks = 0.0, 0
            for p in prompts:
                full, first = [], []
                for _ in range(args.rounds):
                    t_full, ids = timed(llm, p, args.max_tokens)
                    first.append(timed(llm, p, 1)[0])
                    full.append(t_full)
                secs += statistics.median(full) - statistics.median(first)
                toks += len(ids) - 1
                outputs.setdefault(label, []).append(ids)
            rates[label] = toks / secs
            after = llm.engine.stats()
            drafts = after.spec_decode_num_draft_tokens - before.spec_decode_num_draft_tokens
            accepted = (after.spec_decode_num_accepted_tokens
                        - before.spec_decode_num_accepted_tokens)
            events = after.spec_decode_num_drafts - before.spec_decode_num_drafts
            same = outputs[label] == outputs["none"]
            print(f"{name:<12}{label:<12}{rates[label]:>13.1f}{rates[label] / rates['none']:>9.2f}x"
                  f"{(f'{accepted / drafts:.0%}' if drafts else '-'):>10}"
                  f"{(f'{1 + accepted / events:.2f}' if events else '-'):>15}"
                  f"{('yes' if same else 'NO') if TEMPERATURE == 0 else 'n/a':>13}")
        if peer is not None:
            secs, toks = 0.0, 0
            for p, ids in zip(prompts, outputs["none"], strict=True):
                full = [timed_llama_cpp(peer, p, len(ids)) for _ in range(args.rounds)]
                first = [timed_llama_cpp(peer, p, 1) for _ in range(args.rounds)]
                secs += statistics.median(full) - statistics.median(first)
                toks += len(ids) - 1
            rate = toks / secs
            best = max(rates, key=rates.get)
            print(f"{name:<12}{'llama.cpp':<12}{rate:>13.1f}{rate / rates['none']:>9.2f}x"
                  f"{'-':>10}{'-':>15}{'-':>13}   fastest here, {best}: {rates[best] / rate:.2f}x "
                  "llama.cpp")
    if any(s["method"] == "suffix" for s in specs) and "chat" in chosen:
        # The same chat prompts asked again (an agent's retry, a templated answer): the second
        # ask is timed, with the first one's output in a suffix proposer's cache.
        prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": t}],
                                                      tokenize=False, add_generation_prompt=True),
                              add_special_tokens=False) for t in workloads()["chat"]]
        print("\nrepeat: each chat prompt asked twice in a row, the second ask timed")
        rates = {}
        for label, llm in engines.items():
            secs, toks = 0.0, 0
            for p in prompts:
                full, first = [], []
                for _ in range(args.rounds):
                    timed(llm, p, args.max_tokens)  # the first ask
                    t_full, ids = timed(llm, p, args.max_tokens, keep_cache=True)
                    first.append(timed(llm, p, 1, keep_cache=True)[0])
                    full.append(t_full)
                secs += statistics.median(full) - statistics.median(first)
                toks += len(ids) - 1
            rates[label] = toks / secs
            print(f"  {label:<12}{rates[label]:>8.1f} decode tok/s "
                  f"{rates[label] / rates['none']:>6.2f}x")
    if args.batch64:
        vocab = engines["none"].engine.config.model.vocab_size
        reqs = make_workload("uniform", vocab, set(tok.all_special_ids))
        print("\nuniform, 64 requests at once (256 prompt + 128 output tokens each):")
        for label, llm in engines.items():
            params = [SamplingParams(temperature=0, max_tokens=r.output_len, ignore_eos=True)
                      for r in reqs]
            start = time.perf_counter()
            llm.generate([{"prompt_token_ids": r.prompt_token_ids} for r in reqs], params,
                         use_tqdm=False)
            secs = time.perf_counter() - start
            total = sum(len(r.prompt_token_ids) + r.output_len for r in reqs)
            engine = llm.engine
            print(f"  {label:<12}{total / secs:>8.1f} total tokens/s   KV cache "
                  f"{engine.kv.num_usable_blocks * engine.config.cache.block_size} tokens, "
                  f"{engine.scheduler.num_preemptions} preemptions so far")


if __name__ == "__main__":
    main()
