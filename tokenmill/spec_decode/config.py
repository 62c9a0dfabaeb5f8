"""SpeculativeConfig: vLLM's `--speculative-config` JSON, validated at start-up.

    {"method": "ngram", "num_speculative_tokens": 3,
     "prompt_lookup_max": 4, "prompt_lookup_min": 2}

Unknown fields, bad values and methods not built yet are refused with what is supported,
never ignored. (Only "ngram" is built, and it uses every field.)
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any

METHODS = ("ngram",)
# Not built yet; named so that asking for one says so instead of "unknown".
PLANNED_METHODS = ("suffix", "draft_model", "eagle", "eagle3", "mtp")
# A verify step of 1 + k tokens costs about a decode step while it stays within 4 tokens:
# the CPU kernels read each weight once for up to 4 rows (csrc/linear_cpu.h) and the fused
# decode call takes up to 4 tokens (models/cpu_decode.py); beyond, the weights are read again
# per 4 rows. The scheduler drafts only within that (core/scheduler.py SPEC_MAX_STEP_TOKENS).
MAX_SPECULATIVE_TOKENS = 3


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str = "ngram"
    num_speculative_tokens: int = 3
    # ngram: the longest and shortest suffix of the tokens so far to look up earlier in them
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 2

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            planned = " (not built yet)" if self.method in PLANNED_METHODS else ""
            raise ValueError(f"speculative method {self.method!r}{planned}; supported: "
                             f"{', '.join(METHODS)}")
        k = self.num_speculative_tokens
        if not isinstance(k, int) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"num_speculative_tokens must be an integer in 1.."
                             f"{MAX_SPECULATIVE_TOKENS}, got {k!r}")
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        if not (isinstance(lo, int) and isinstance(hi, int) and 1 <= lo <= hi):
            raise ValueError(f"ngram needs 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                             f"{lo!r} and {hi!r}")

    @staticmethod
    def parse(value: SpeculativeConfig | dict[str, Any] | str | None
              ) -> SpeculativeConfig | None:
        """From a config, a dict or a JSON string (the CLI flag); None: no speculation."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"--speculative-config is not valid JSON: {e}") from None
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a JSON object, got {value!r}")
        known = {f.name for f in fields(SpeculativeConfig)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"unknown speculative_config field(s) {', '.join(unknown)}; "
                             f"known: {', '.join(sorted(known))}")
        return SpeculativeConfig(**value)
