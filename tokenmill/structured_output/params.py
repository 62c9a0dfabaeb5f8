"""StructuredOutputsParams: what a request's output must match (vLLM's names and meanings).

Exactly one constraint per request:
- `json`: a JSON schema (a dict or its JSON text); the output is one JSON value valid under it;
- `json_object`: any JSON object (OpenAI's `response_format: {"type": "json_object"}`), nested
  at most 4 levels deep (backend.JSON_OBJECT_MAX_DEPTH: a small model may otherwise nest
  until max_tokens cuts it off);
- `regex`: the whole output matches the regular expression;
- `choice`: the output is one of these strings;
- `grammar`: a context-free grammar, in Lark syntax (llguidance's) or GBNF (llama.cpp's).
Options, as in vLLM: `disable_any_whitespace` (JSON with no whitespace at all between
tokens), `disable_additional_properties` (objects of a schema take only the properties it
names), `whitespace_pattern` (the regex JSON whitespace must match). Without them, JSON uses
", " and ": " between items and nothing else: a small model left free to put any whitespace
between tokens may emit newlines until max_tokens ends it (SmolLM2 did under vLLM's default),
which is valid JSON that never closes.

Invariant: a constructed instance names exactly one constraint of the right type; `kind` and
`spec` (canonical text) identify the compiled grammar it needs, so equal constraints share one.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

KINDS = ("json", "json_object", "regex", "choice", "grammar")


@dataclass
class StructuredOutputsParams:
    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None
    structural_tag: str | None = None

    def __post_init__(self) -> None:
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError("structured_outputs must set exactly one of json, json_object, "
                             f"regex, choice or grammar; got {given or 'none'}")
        if self.structural_tag is not None:
            raise ValueError("structured_outputs.structural_tag is not supported; use json, "
                             "regex, choice or grammar")
        if isinstance(self.json, str):
            try:
                self.json = _loads_object(self.json)
            except ValueError as e:
                raise ValueError(f"structured_outputs.json must be a JSON schema: {e}") from None
        if self.json is not None and not isinstance(self.json, dict | bool):
            raise ValueError("structured_outputs.json must be a JSON schema (an object), got "
                             f"{type(self.json).__name__}")
        for name in ("regex", "grammar", "whitespace_pattern"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured_outputs.{name} must be a non-empty string")
        if self.choice is not None:
            if (not isinstance(self.choice, list | tuple) or not self.choice
                    or not all(isinstance(c, str) and c for c in self.choice)):
                raise ValueError("structured_outputs.choice must be a non-empty list of "
                                 "non-empty strings")
            self.choice = list(self.choice)
        if self.json_object is not None and not isinstance(self.json_object, bool):
            raise ValueError("structured_outputs.json_object must be a boolean")
        if self.disable_any_whitespace and self.whitespace_pattern is not None:
            raise ValueError("structured_outputs: disable_any_whitespace and "
                             "whitespace_pattern contradict each other")

    @classmethod
    def from_dict(cls, fields: dict[str, Any]) -> StructuredOutputsParams:
        """From a JSON object (the API's, or SamplingParams given a dict); ValueError naming
        an unknown field."""
        try:
            return cls(**fields)
        except TypeError as e:
            raise ValueError(f"structured_outputs: {e}") from None

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    @property
    def spec(self) -> str:
        """The constraint and its options as canonical text (the compiled-grammar cache key)."""
        value = {"json": self.json, "json_object": True, "regex": self.regex,
                 "choice": self.choice, "grammar": self.grammar}[self.kind]
        options = (self.disable_any_whitespace, self.disable_additional_properties,
                   self.whitespace_pattern)
        return json.dumps([value, options], sort_keys=True, separators=(",", ":"))


def _loads_object(text: str) -> Any:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"not valid JSON ({e})") from None
    return value
