"""The interface a grammar library is used through (llguidance by default, xgrammar optional).

A backend compiles a constraint once (`compile` → `CompiledGrammar`, cached by the manager per
(kind, spec)); each request sample gets its own `GrammarMatcher` from it, which follows the
tokens the request has emitted. Token masks are int32 bitmasks, bit j of word i allowing token
32 i + j, of the model's full logits width (tokens the tokenizer lacks are never allowed).

Invariants of a matcher: its state is the request's output tokens so far (`accept` after each
emitted token); `fill_bitmask` and `validate` do not change it; `rollback(n)` undoes the last
n accepted tokens (speculative decoding checks drafts by accepting and rolling back).
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from tokenmill.structured_output.params import StructuredOutputsParams


class GrammarMatcher(ABC):
    @abstractmethod
    def accept(self, token_id: int) -> bool:
        """Advance past an emitted token; False if the grammar does not allow it."""

    @abstractmethod
    def validate(self, token_ids: list[int]) -> int:
        """How many leading tokens of `token_ids` the grammar allows from here (no change)."""

    @abstractmethod
    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` accepted tokens."""

    @abstractmethod
    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the tokens allowed next into row `row` of `bitmask` (int32, (R, W), CPU)."""

    @abstractmethod
    def forced_tokens(self) -> list[int]:
        """Tokens the grammar forces next, whatever the model would say (jump-forward); only
        those whose tokenization cannot change with what follows them."""

    @abstractmethod
    def is_terminated(self) -> bool:
        """The grammar is complete and has accepted the end (EOS): nothing may follow."""

    @abstractmethod
    def error(self) -> str | None:
        """Why the matcher cannot go on (a dead end), or None."""

    def constrains(self) -> bool:
        """Whether the next token is constrained at all (False: any token may come, and the
        step needs no mask for it)."""
        return True

    def decided_ahead(self) -> bool:
        """Whether the mask after one more token, whichever it is, is known now (then the
        request may be scheduled a step ahead of its sampled token: async scheduling). A
        grammar's mask depends on the token: no."""
        return False


class CompiledGrammar(ABC):
    @abstractmethod
    def matcher(self) -> GrammarMatcher:
        """A new matcher at the start of the grammar."""


class StructuredOutputBackend(ABC):
    name: str

    @abstractmethod
    def compile(self, params: StructuredOutputsParams) -> CompiledGrammar:
        """Compile a constraint; ValueError with the reason if it is invalid or unsupported."""


def bitmask_width(vocab_size: int) -> int:
    """int32 words per row of a bitmask over `vocab_size` tokens."""
    return (vocab_size + 31) // 32


# json_object: an object whose values nest at most this deep. Left unbounded, SmolLM2 nested
# {"type": ..., "data": {...}} until max_tokens cut it off (valid JSON that never closes).
JSON_OBJECT_MAX_DEPTH = 4


def json_object_schema(max_depth: int = JSON_OBJECT_MAX_DEPTH) -> dict:
    """Any JSON object with at most `max_depth` levels of objects and arrays."""
    scalars = [{"type": "string"}, {"type": "number"}, {"type": "boolean"}, {"type": "null"}]
    value: dict = {"anyOf": scalars}
    for _ in range(max_depth - 1):
        value = {"anyOf": [*scalars, {"type": "array", "items": value},
                           {"type": "object", "additionalProperties": value}]}
    return {"type": "object", "additionalProperties": value}


def json_schema_of(params: StructuredOutputsParams) -> dict | bool:
    """The schema a json / json_object constraint is compiled from. Objects that do not say
    take no properties beyond those they name (xgrammar's strict mode, vLLM's default):
    every answer still validates against the given schema, and SmolLM2, free to add
    properties, added an unbounded array to one until max_tokens cut it off.
    `disable_additional_properties` also overrides objects that allow more."""
    schema = json_object_schema() if params.kind == "json_object" else params.json
    return _close_objects(schema, force=params.disable_additional_properties)


def _close_objects(node: object, force: bool) -> object:
    if isinstance(node, list):
        return [_close_objects(x, force) for x in node]
    if not isinstance(node, dict):
        return node
    out = {k: v if k in ("enum", "const", "default", "examples") else _close_objects(v, force)
           for k, v in node.items()}
    is_object = out.get("type") == "object" or "properties" in out
    if is_object and (force or "additionalProperties" not in out):
        out["additionalProperties"] = False
    return out
