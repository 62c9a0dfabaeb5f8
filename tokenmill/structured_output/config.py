"""StructuredOutputsConfig: the engine-wide choices (vLLM's `--structured-outputs-config` JSON).

- `backend`: "auto" (llguidance, else xgrammar if only that is installed), "guidance" (alias
  "llguidance") or "xgrammar".
- `jump_forward`: append the tokens a grammar forces without a model step each (SGLang's
  jump-forward decoding); on by default. Requests that ask for logprobs never jump (forced
  tokens have no logprobs).
- `enable_in_reasoning` (vLLM's): with a reasoning parser, a request's grammar applies from
  its first token; by default it applies from where the reasoning ends (reasoning/gate.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tokenmill.utils.json_option import json_object

BACKENDS = ("auto", "guidance", "llguidance", "xgrammar")


@dataclass(frozen=True)
class StructuredOutputsConfig:
    backend: str = "auto"
    jump_forward: bool = True
    enable_in_reasoning: bool = False

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"structured_outputs_config: backend must be one of "
                             f"{', '.join(BACKENDS)}, got {self.backend!r}")
        for name in ("jump_forward", "enable_in_reasoning"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"structured_outputs_config: {name} must be true or false")

    @staticmethod
    def parse(value: str | dict[str, Any] | StructuredOutputsConfig | None
              ) -> StructuredOutputsConfig:
        if value is None:
            return StructuredOutputsConfig()
        if isinstance(value, StructuredOutputsConfig):
            return value
        value = json_object(value, "structured_outputs_config")
        unknown = set(value) - {"backend", "jump_forward", "enable_in_reasoning"}
        if unknown:
            raise ValueError(f"structured_outputs_config: unknown field(s) "
                             f"{', '.join(sorted(unknown))}; known: backend, jump_forward, "
                             "enable_in_reasoning")
        return StructuredOutputsConfig(**value)
