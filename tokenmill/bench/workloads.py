"""The standard benchmark workloads of shared/README.md, drawn from one seeded generator.

Prompts are random token ids drawn uniformly from the vocabulary minus special tokens; every
request sets ignore_eos so output lengths are exactly as drawn.
"""

from __future__ import annotations

import random
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
    if name == "single-stream":
        return [BenchRequest(draw(128), 256)]
    raise ValueError(f"unknown workload {name!r}; known: uniform, mixed, single-stream")


def load_workload(model: str | None, name: str, seed: int = 0,
                  num_requests: int | None = None) -> list[BenchRequest]:
    """`make_workload` over a model's vocabulary, special tokens excluded."""
    from tokenmill.config import ModelConfig
    from tokenmill.engine.tokenizer import load_tokenizer

    mc = ModelConfig.from_path(model)
    special = set(load_tokenizer(mc).all_special_ids)
    return make_workload(name, mc.vocab_size, special, seed, num_requests)
