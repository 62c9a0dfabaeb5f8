"""The standard benchmark workloads of shared/README.md, drawn from one seeded generator.

Prompts are random token ids drawn uniformly from the vocabulary minus special tokens; every
request sets ignore_eos so output lengths are exactly as drawn.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class BenchRequest:
    prompt_token_ids: list[int]
    output_len: int


def make_workload(name: str, vocab_size: int, special_ids: set[int], seed: int = 0,
                  num_requests: int | None = None) -> list[BenchRequest]:
    rng = random.Random(seed)
    allowed = [t for t in range(vocab_size) if t not in special_ids]
    draw = lambda n: [rng.choice(allowed) for _ in range(n)]
    if name == "uniform":
        n = num_requests or 64
        return [BenchRequest(draw(256), 128) for _ in range(n)]
    if name == "mixed":
        n = num_requests or 128
        return [BenchRequest(draw(rng.randint(32, 512)), rng.randint(16, 256)) for _ in range(n)]
    if name == "sharegpt":
        n = num_requests or 1000
        return [BenchRequest(draw(_lognormal_len(rng, *SHAREGPT_PROMPT)),
                             _lognormal_len(rng, *SHAREGPT_OUTPUT)) for _ in range(n)]
    if name == "single-stream":
        return [BenchRequest(draw(128), 256)]
    if name == "shared-prefix":
        system = draw(1024)
        return [BenchRequest(system + draw(64), 32) for _ in range(num_requests or 64)]
    if name == "multi-turn":  # conversation-major: conversation c's turns at 4c .. 4c + 3
        return [turn for conv in make_conversations(draw, num_requests or 16)
                for turn in conv]
    raise ValueError(f"unknown workload {name!r}; known: uniform, mixed, sharegpt, "
                     "shared-prefix, multi-turn, single-stream")


# sharegpt: lengths shaped like vLLM's ShareGPT benchmark set (prompts under 1,024 tokens,
# outputs as answered; 1,000 drawn: mean prompt 238, output 185 tokens, long-tailed), drawn from a
# fixed log-normal (median, sigma, min, max) instead of downloading the dataset
SHAREGPT_PROMPT = (140, 1.0, 4, 1024)
SHAREGPT_OUTPUT = (135, 0.9, 4, 512)


def _lognormal_len(rng: random.Random, median: int, sigma: float, lo: int, hi: int) -> int:
    return min(hi, max(lo, round(rng.lognormvariate(math.log(median), sigma))))


def make_conversations(draw: Callable[[int], list[int]], num_conversations: int,
                       turns: int = 4) -> list[list[BenchRequest]]:
    """multi-turn: each turn resends the whole history, then 64 new tokens; a turn's answer
    (64 tokens) stands in the next turn's history as drawn tokens (what a client resends is
    the text it was given; a drawn stand-in keeps the workload independent of the model)."""
    conversations = []
    for _ in range(num_conversations):
        history: list[int] = []
        conv = []
        for _ in range(turns):
            prompt = history + draw(64)
            conv.append(BenchRequest(prompt, 64))
            history = prompt + draw(64)
        conversations.append(conv)
    return conversations


def load_workload(model: str | None, name: str, seed: int = 0,
                  num_requests: int | None = None) -> list[BenchRequest]:
    """`make_workload` over a model's vocabulary, special tokens excluded."""
    from tokenmill.config_model import model_config
    from tokenmill.engine.tokenizer import load_tokenizer

    mc = model_config(model)
    special = set(load_tokenizer(mc).all_special_ids)
    return make_workload(name, mc.vocab_size, special, seed, num_requests)
