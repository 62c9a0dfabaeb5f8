"""What a thinking budget costs a batch, in one run (reasoning/gate.py).

    python benchmarks/thinking_budget.py [--rounds 3] [--batch 16] [--tokens 128]
        [--budget 64] [--async-scheduling]

A batch of chat requests on SmolLM2 (greedy, the engine started with --reasoning-parser
deepseek_r1, so an answer reasons from its first token), each with thinking_token_budget
`--budget`: the engine forces "</think>" after that many tokens and the answer goes on to
`--tokens`. Against it, the same batch without a budget. Both ignore EOS and end at exactly
`--tokens` tokens each, so they do the same prefill and decode work; what differs is the gate:
a budgeted request takes a token mask each step (all tokens allowed until the budget is spent,
then only the end's tokens), the forced end is appended without a model step (jump-forward),
and under async scheduling the step that may spend the budget waits for its sampled token
(the others are scheduled ahead as without a budget: GrammarMatcher.decided_ahead).
Decode tokens/s = output tokens / (batch time - the same batch cut to one token); rounds
alternate the two and the median is kept. It also checks that each budgeted answer holds
"</think>" right after `--budget` tokens.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tokenmill import LLM, SamplingParams  # noqa: E402
from tokenmill.bench.machine import describe_machine  # noqa: E402

TOPICS = ["the Eiffel Tower", "Marie Curie", "the bicycle", "democracy", "Mount Everest",
          "Ada Lovelace", "the telephone", "the Amazon river", "jazz music", "Isaac Newton",
          "the printing press", "Tokyo", "photosynthesis", "the Great Wall of China",
          "Leonardo da Vinci", "the internet"]


def chat_prompt(llm: LLM, text: str) -> list[int]:
    tok = llm.get_tokenizer()
    return tok.encode(tok.apply_chat_template([{"role": "user", "content": text}],
                                              tokenize=False, add_generation_prompt=True),
                      add_special_tokens=False)


def run(llm: LLM, prompts: list[list[int]], params: SamplingParams
        ) -> tuple[float, list[list[int]]]:
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return time.perf_counter() - start, [list(o.outputs[0].token_ids) for o in outs]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--budget", type=int, default=64)
    ap.add_argument("--async-scheduling", action="store_true")
    args = ap.parse_args()
    llm = LLM(reasoning_parser="deepseek_r1", async_scheduling=args.async_scheduling or None)
    end = llm.get_tokenizer().encode("</think>", add_special_tokens=False)
    print(describe_machine())
    print(f"SmolLM2-135M-Instruct, weights {llm.engine.config.model.quantization or 'float32'}, "
          f"batch {args.batch}, {args.tokens} tokens each, budget {args.budget}, greedy, "
          f"async scheduling {llm.engine.config.scheduler.async_scheduling}, "
          f"{args.rounds} rounds")
    topics = (TOPICS * (args.batch // len(TOPICS) + 1))[:args.batch]
    prompts = [chat_prompt(llm, f"Tell me about {t}.") for t in topics]
    params = {
        "no budget": SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True),
        "budget": SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True,
                                 thinking_token_budget=args.budget)}
    _, budgeted = run(llm, prompts, params["budget"])  # (warms the engine up too)
    forced = sum(ids[args.budget:args.budget + len(end)] == end for ids in budgeted)
    secs: dict[str, list[float]] = {k: [] for k in params}
    for _ in range(args.rounds):
        for label, p in params.items():
            full, ids = run(llm, prompts, p)
            first, _ = run(llm, prompts, SamplingParams(
                temperature=0, max_tokens=1, ignore_eos=True,
                thinking_token_budget=p.thinking_token_budget))
            assert all(len(i) == args.tokens for i in ids), label
            secs[label].append(full - first)
    tokens = args.batch * (args.tokens - 1)
    print(f"\n{forced}/{args.batch} budgeted answers hold </think> right after "
          f"{args.budget} tokens")
    print(f"{'batch':<12}{'decode tok/s':>13}{'vs no budget':>14}")
    base = tokens / statistics.median(secs["no budget"])
    for label in params:
        rate = tokens / statistics.median(secs[label])
        print(f"{label:<12}{rate:>13.1f}{rate / base:>13.2f}x")


if __name__ == "__main__":
    main()
