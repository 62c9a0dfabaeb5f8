"""StructuredOutputsConfig: the engine-wide choices (vLLM's `--structured-outputs-config` JSON).

- `backend`: "auto" (llguidance, else xgrammar if only that is installed), "guidance" (alias
  "llguidance") or "xgrammar".
- `jump_forward`: append the tokens a grammar forces without a model step each (SGLang's
  jump-forward decoding); on by default. Requests that ask for logprobs never jump (forced
  tokens have no logprobs).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

BACKENDS = ("auto", "guidance", "llguidance", "xgrammar")


@dataclass(frozen=True)
class StructuredOutputsConfig:
    backend: str = "auto"
    jump_forward: bool = True

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"structured_outputs_config: backend must be one of "
                             f"{', '.join(BACKENDS)}, got {self.backend!r}")
        if not isinstance(self.jump_forward, bool):
            raise ValueError("structured_outputs_config: jump_forward must be true or false")

    @staticmethod
    def parse(value: str | dict[str, Any] | StructuredOutputsConfig | None
              ) -> StructuredOutputsConfig:
        if value is None:
            return StructuredOutputsConfig()
        if isinstance(value, StructuredOutputsConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"structured_outputs_config is not valid JSON: {e}") from None
        if not isinstance(value, dict):
            raise ValueError("structured_outputs_config must be a JSON object")
        unknown = set(value) - {"backend", "jump_forward"}
        if unknown:
            raise ValueError(f"structured_outputs_config: unknown field(s) "
                             f"{', '.join(sorted(unknown))}; known: backend, jump_forward")
        return StructuredOutputsConfig(**value)
