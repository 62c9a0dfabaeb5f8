"""Options given as JSON objects (vLLM's `--speculative-config '{...}'` style flags)."""

from __future__ import annotations

import json
from typing import Any


def json_object(value: str | dict[str, Any], name: str) -> dict[str, Any]:
    """`value` as a dict: parsed if it is JSON text; ValueError naming the option otherwise."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"{name} is not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{name} must be a JSON object, got {value!r}")
    return value
