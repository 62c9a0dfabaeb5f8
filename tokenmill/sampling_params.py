"""SamplingParams: what a request asks of the sampler, the stop checker and the detokenizer.

Names and meanings follow vLLM's `SamplingParams`, so user code moves over unchanged. Every field
is validated in `__post_init__` with a `ValueError` that names the field and its limit; nothing is
silently clamped. Greedy decoding is `temperature == 0`.

Order of logit processing (as in vLLM): logit_bias and the min_tokens ban, then repetition /
frequency / presence penalties, then (random sampling only) temperature, min_p, top-k, top-p.
Logprobs are those of the raw model output (log_softmax of the logits, before any processing);
with `structured_outputs`, the grammar's token mask comes first (as in vLLM).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import IntEnum
from typing import Any

from tokenmill.structured_output.params import StructuredOutputsParams

# Below this temperature we sample greedily, as vLLM does, to avoid dividing by ~0.
_GREEDY_EPS = 1e-5
MAX_LOGPROBS = 20  # vLLM's default max_logprobs (the OpenAI API's cap on top_logprobs)
# Seeds are 64-bit signed integers, as in vLLM's API: torch generators take no more.
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1


class RequestOutputKind(IntEnum):
    """What each RequestOutput of a request holds (vLLM's `RequestOutputKind`, same values).

    CUMULATIVE: everything so far, at every step (the default). DELTA: only what is new since
    the request's previous output (text, token_ids, logprobs; cumulative_logprob stays the
    running total; prompt_logprobs come with the first output only), and only the samples that
    changed. FINAL_ONLY: one output, when the request finishes (`LLM.generate` asks this:
    nothing is built for the steps in between)."""

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1 disables top-k
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    max_tokens: int | None = 16  # None: up to the model's context length
    min_tokens: int = 0
    logprobs: int | None = None  # top alternatives per generated token (0: the chosen one only)
    prompt_logprobs: int | None = None
    logit_bias: dict[int, float] | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    # the output must match a JSON schema, regex, choice or grammar (structured_output/)
    structured_outputs: StructuredOutputsParams | dict[str, Any] | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    # vLLM's: only these token ids may be sampled (None: any)
    allowed_token_ids: list[int] | None = None
    # vLLM's: only the prompt's last k tokens are kept (-1: the last max_model_len)
    truncate_prompt_tokens: int | None = None
    # vLLM's: words never generated (each as tokenized alone and after a space)
    bad_words: list[str] | None = None
    # vLLM's: at most this many tokens of reasoning, then the end of thinking is forced (needs
    # the engine's reasoning_parser or reasoning_config: reasoning/gate.py)
    thinking_token_budget: int | None = None

    def __post_init__(self) -> None:
        self._check_int("n", self.n, 1)
        if self.thinking_token_budget is not None:
            self._check_int("thinking_token_budget", self.thinking_token_budget, 0)
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = list(self.allowed_token_ids)
            if not self.allowed_token_ids:
                raise ValueError("allowed_token_ids must not be empty (None allows any)")
            for t in self.allowed_token_ids:
                self._check_int("allowed_token_ids", t, 0)
        if self.bad_words is not None:
            self.bad_words = [self.bad_words] if isinstance(self.bad_words, str) else list(
                self.bad_words)
            if not all(isinstance(w, str) and w.strip() for w in self.bad_words):
                raise ValueError(f"bad_words must be non-blank strings, got {self.bad_words!r}")
        if self.truncate_prompt_tokens is not None and self.truncate_prompt_tokens != -1:
            self._check_int("truncate_prompt_tokens", self.truncate_prompt_tokens, 1)
        _check_range("temperature", self.temperature, 0.0, None)
        _check_range("top_p", self.top_p, 0.0, 1.0)
        if self.top_p == 0.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k == -1:
            self.top_k = 0
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < 0:
            raise ValueError(f"top_k must be -1 or 0 (disabled) or >= 1, got {self.top_k!r}")
        _check_range("min_p", self.min_p, 0.0, 1.0)
        _check_range("presence_penalty", self.presence_penalty, -2.0, 2.0)
        _check_range("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        _check_range("repetition_penalty", self.repetition_penalty, 0.0, None)
        if self.repetition_penalty == 0.0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if self.max_tokens is not None:
            self._check_int("max_tokens", self.max_tokens, 1)
        self._check_int("min_tokens", self.min_tokens, 0)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must be <= max_tokens "
                             f"({self.max_tokens})")
        if self.seed is not None:
            self._check_int("seed", self.seed, SEED_MIN, SEED_MAX)
        for name in ("logprobs", "prompt_logprobs"):  # (at most max_logprobs: the engine's)
            value = getattr(self, name)
            if value is not None:
                self._check_int(name, value, 0)
        self.stop = _normalize_stop(self.stop)
        self.stop_token_ids = list(self.stop_token_ids or [])
        for t in self.stop_token_ids:
            if not isinstance(t, int) or t < 0:
                raise ValueError(f"stop_token_ids must hold non-negative integers, got {t!r}")
        self.logit_bias = _normalize_logit_bias(self.logit_bias)
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams.from_dict(self.structured_outputs)
        elif not isinstance(self.structured_outputs, StructuredOutputsParams | None):
            raise ValueError("structured_outputs must be a StructuredOutputsParams, got "
                             f"{type(self.structured_outputs).__name__}")
        if (not isinstance(self.output_kind, int) or isinstance(self.output_kind, bool)
                or self.output_kind not in set(RequestOutputKind)):
            raise ValueError("output_kind must be a RequestOutputKind (0 CUMULATIVE, 1 DELTA, "
                             f"2 FINAL_ONLY), got {self.output_kind!r}")
        self.output_kind = RequestOutputKind(self.output_kind)

    @staticmethod
    def _check_int(name: str, value: object, low: int, high: int | None = None) -> None:
        if (not isinstance(value, int) or isinstance(value, bool) or value < low
                or (high is not None and value > high)):
            bounds = f"in [{low}, {high}]" if high is not None else f">= {low}"
            raise ValueError(f"{name} must be an integer {bounds}, got {value!r}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    @property
    def has_penalties(self) -> bool:
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)

    @property
    def stop_buffer_length(self) -> int:
        """Characters held back from streamed text, in case they begin a stop string."""
        return max((len(s) for s in self.stop), default=1) - 1 if self.stop else 0


def _check_range(name: str, value: float, low: float | None, high: float | None) -> None:
    if not isinstance(value, int | float) or isinstance(value, bool) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    if (low is not None and value < low) or (high is not None and value > high):
        bounds = f"in [{low}, {high}]" if high is not None else f">= {low}"
        raise ValueError(f"{name} must be {bounds}, got {value}")


def _normalize_stop(stop: str | list[str] | None) -> list[str]:
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    for s in stops:
        if not isinstance(s, str) or not s:
            raise ValueError(f"stop must be a non-empty string or a list of them, got {s!r}")
    return stops


def _normalize_logit_bias(bias: dict | None) -> dict[int, float]:
    out: dict[int, float] = {}
    for key, value in (bias or {}).items():
        try:
            token = int(key)  # the OpenAI API sends token ids as JSON string keys
        except (TypeError, ValueError):
            raise ValueError(f"logit_bias keys must be token ids, got {key!r}") from None
        if token < 0:
            raise ValueError(f"logit_bias keys must be token ids >= 0, got {token}")
        if (not isinstance(value, int | float) or isinstance(value, bool)
                or not -100.0 <= value <= 100.0):
            raise ValueError(f"logit_bias values must be in [-100, 100], got {value!r}")
        out[token] = float(value)
    return out


@dataclass
class BeamSearchParams:
    """Beam search as in vLLM's `LLM.beam_search` and Hugging Face's `num_beams` generation."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    length_penalty: float = 1.0

    def __post_init__(self) -> None:
        SamplingParams._check_int("beam_width", self.beam_width, 1)
        SamplingParams._check_int("max_tokens", self.max_tokens, 1)
        if 2 * self.beam_width > MAX_LOGPROBS:
            raise ValueError(f"beam_width must be <= {MAX_LOGPROBS // 2}, got {self.beam_width}")
        _check_range("length_penalty", self.length_penalty, None, None)
