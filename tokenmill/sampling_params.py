"""SamplingParams: what a request asks of the sampler and of the stop checker.

Names and meanings follow vLLM's `SamplingParams` so user code moves over unchanged. Every field
is validated in `__post_init__` with a `ValueError` that names the field and its limit; nothing is
silently clamped. Greedy decoding is `temperature == 0`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# Below this temperature we sample greedily, as vLLM does, to avoid dividing by ~0.
_GREEDY_EPS = 1e-5


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1 disables top-k
    seed: int | None = None
    max_tokens: int | None = 16  # None: up to the model's context length
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.n, int) or self.n < 1:
            raise ValueError(f"n must be an integer >= 1, got {self.n!r}")
        if self.n != 1:
            raise ValueError("n > 1 (parallel sampling) is not supported yet; use n=1")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k == -1:
            self.top_k = 0
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be -1 or 0 (disabled) or >= 1, got {self.top_k!r}")
        if self.max_tokens is not None and (
            not isinstance(self.max_tokens, int) or self.max_tokens < 1
        ):
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if self.seed is not None and not isinstance(self.seed, int):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")
        self.stop_token_ids = list(self.stop_token_ids or [])
        for t in self.stop_token_ids:
            if not isinstance(t, int) or t < 0:
                raise ValueError(f"stop_token_ids must hold non-negative integers, got {t!r}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS
