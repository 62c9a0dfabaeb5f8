"""SpeculativeConfig: vLLM's `--speculative-config` JSON, validated at start-up.

    {"method": "ngram", "num_speculative_tokens": 3,
     "prompt_lookup_max": 4, "prompt_lookup_min": 2}
    {"method": "suffix", "num_speculative_tokens": 3, "suffix_decoding_max_tree_depth": 24}
    {"method": "draft_model", "model": PATH, "quantization": "gguf", "num_speculative_tokens": 3}

`draft_model` without `model` drafts with the target's own checkpoint in another weight format
(`quantization`, e.g. the GGUF blocks or int8 for a float32 target): self-speculation, no extra
weights. Unknown fields, fields of another method, bad values and methods not built yet are
refused with what is supported, never ignored.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from tokenmill.utils.json_option import json_object

METHODS = ("ngram", "suffix", "draft_model")
# Not built yet; named so that asking for one says so instead of "unknown".
PLANNED_METHODS = ("eagle", "eagle3", "mtp")
# The fields each method reads (besides method and num_speculative_tokens).
METHOD_FIELDS = {"ngram": ("prompt_lookup_max", "prompt_lookup_min"),
                 "suffix": ("suffix_decoding_max_tree_depth",
                            "suffix_decoding_max_cached_requests",
                            "suffix_decoding_max_spec_factor", "suffix_decoding_min_token_prob"),
                 "draft_model": ("model", "quantization")}
# vLLM takes any positive count; a verify step of 1 + k tokens then runs through the modules
# past the fused decode call's 4 (models/cpu_decode.py), and the draft-length policy weighs
# each k by the measured cost of such steps (policy.py, cost_model.py). Beyond 32 a step
# could not pay for itself at any acceptance on these machines.
MAX_SPECULATIVE_TOKENS = 32


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str = "ngram"
    num_speculative_tokens: int = 3
    # ngram: the longest and shortest suffix of the tokens so far to look up earlier in them
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 2
    # draft_model: the draft's checkpoint (None: the target's own) and weight format (None:
    # the checkpoint's default, as for a target; "none": dense)
    model: str | None = None
    quantization: str | None = None
    # suffix (vLLM's names; spec_decode/suffix.py): the longest suffix of a request looked up,
    # finished requests' outputs kept (vLLM keeps 10000 in a C++ tree; a scan here), draft
    # length per matched token, and the least share of occurrences a drafted token must have
    suffix_decoding_max_tree_depth: int = 24
    suffix_decoding_max_cached_requests: int = 1000
    suffix_decoding_max_spec_factor: float = 1.0
    suffix_decoding_min_token_prob: float = 0.1

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            planned = " (not built yet)" if self.method in PLANNED_METHODS else ""
            raise ValueError(f"speculative method {self.method!r}{planned}; supported: "
                             f"{', '.join(METHODS)}")
        k = self.num_speculative_tokens
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"num_speculative_tokens must be an integer in 1.."
                             f"{MAX_SPECULATIVE_TOKENS}, got {k!r}")
        if self.method != "draft_model" and (self.model is not None
                                             or self.quantization is not None):
            raise ValueError(f"method {self.method!r} drafts from tokens already seen: it takes "
                             "no model or quantization (use method 'draft_model')")
        if self.method == "draft_model" and self.model is None and self.quantization is None:
            raise ValueError("method 'draft_model' needs a draft 'model', or a 'quantization' "
                             "for the target's own weights to draft in (e.g. 'gguf', 'int8')")
        depth = self.suffix_decoding_max_tree_depth
        cached = self.suffix_decoding_max_cached_requests
        if not (isinstance(depth, int) and 1 <= depth <= 1024):
            raise ValueError(f"suffix_decoding_max_tree_depth must be an integer in 1..1024, got "
                             f"{depth!r}")
        if not (isinstance(cached, int) and cached >= 0):
            raise ValueError(f"suffix_decoding_max_cached_requests must be an integer >= 0, got "
                             f"{cached!r}")
        if not (isinstance(self.suffix_decoding_max_spec_factor, int | float)
                and self.suffix_decoding_max_spec_factor > 0):
            raise ValueError(f"suffix_decoding_max_spec_factor must be > 0, got "
                             f"{self.suffix_decoding_max_spec_factor!r}")
        if not (isinstance(self.suffix_decoding_min_token_prob, int | float)
                and 0 <= self.suffix_decoding_min_token_prob <= 1):
            raise ValueError(f"suffix_decoding_min_token_prob must be in [0, 1], got "
                             f"{self.suffix_decoding_min_token_prob!r}")
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
        value = json_object(value, "speculative_config")
        known = {f.name for f in fields(SpeculativeConfig)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"unknown speculative_config field(s) {', '.join(unknown)}; "
                             f"known: {', '.join(sorted(known))}")
        method = value.get("method", "ngram")
        foreign = sorted(f for m, names in METHOD_FIELDS.items() if m != method
                         for f in names if f in value and f not in METHOD_FIELDS.get(method, ()))
        if foreign and method in METHODS:
            raise ValueError(f"speculative_config field(s) {', '.join(foreign)} do not apply "
                             f"to method {method!r}; it reads "
                             f"{', '.join(METHOD_FIELDS[method])}")
        return SpeculativeConfig(**value)
