"""The llguidance backend (the default): Lark / GBNF grammars, JSON schema, regex and choice,
masks computed lazily by its Earley parser over a token trie (~30 µs for SmolLM2's 49k tokens).

llguidance's matchers never raise on grammar errors: a bad constraint gives a matcher in an
error state, which `compile` turns into a ValueError with the library's reason. A grammar is
compiled once into a template matcher; each request sample deep-copies it (cheap).
"""

from __future__ import annotations

import json
from typing import Any

import torch

from tokenmill.structured_output.backend import (
    CompiledGrammar,
    GrammarMatcher,
    StructuredOutputBackend,
    json_schema_of,
)
from tokenmill.structured_output.params import StructuredOutputsParams


class LLGuidanceMatcher(GrammarMatcher):
    def __init__(self, matcher: Any) -> None:
        self._m = matcher

    def accept(self, token_id: int) -> bool:
        return bool(self._m.consume_token(token_id))

    def validate(self, token_ids: list[int]) -> int:
        return int(self._m.validate_tokens(token_ids))

    def rollback(self, num_tokens: int) -> None:
        if num_tokens and not self._m.rollback(num_tokens):
            raise RuntimeError(f"llguidance could not roll back {num_tokens} tokens: "
                               f"{self._m.get_error()}")

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        view = bitmask[row]  # (W,) contiguous int32 on CPU
        self._m.unsafe_compute_mask_ptr(view.data_ptr(), view.numel() * view.element_size())

    def forced_tokens(self) -> list[int]:
        return list(self._m.compute_ff_tokens())

    def is_terminated(self) -> bool:
        return bool(self._m.is_stopped()) and not self._m.is_error()

    def error(self) -> str | None:
        return self._m.get_error() if self._m.is_error() else None


class LLGuidanceGrammar(CompiledGrammar):
    def __init__(self, template: Any) -> None:
        self._template = template

    def matcher(self) -> LLGuidanceMatcher:
        return LLGuidanceMatcher(self._template.deep_copy())


class LLGuidanceBackend(StructuredOutputBackend):
    name = "guidance"

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: list[int]) -> None:
        import llguidance
        import llguidance.hf

        self._ll = llguidance
        # the model's full logits width: ids past the tokenizer's vocabulary stay disallowed
        self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size,
                                                      eos_token=list(eos_token_ids))

    def compile(self, params: StructuredOutputsParams) -> LLGuidanceGrammar:
        matcher = self._ll.LLMatcher(self.tokenizer, self._grammar(params), log_level=0)
        if matcher.is_error():
            raise ValueError(f"structured_outputs.{params.kind} is invalid or unsupported: "
                             f"{matcher.get_error().strip()}")
        return LLGuidanceGrammar(matcher)

    def _grammar(self, params: StructuredOutputsParams) -> str:
        ll = self._ll
        kind = params.kind
        if kind in ("json", "json_object"):
            try:
                return ll.LLMatcher.grammar_from_json_schema(json_schema_of(params),
                                                             overrides=_json_options(params))
            except ValueError as e:
                raise ValueError(f"structured_outputs.{kind} is not a JSON schema: {e}") from None
        if kind == "regex":
            # \d is [0-9] (JSON schema's and xgrammar's meaning); the regex crate's Unicode
            # digits let SmolLM2 answer a phone-number pattern in "segmented digit" symbols
            return ll.LLMatcher.grammar_from_lark(f"start: /{ll.regex_to_lark(params.regex, 'd')}/")
        if kind == "choice":
            lark = "start: " + " | ".join(json.dumps(c) for c in params.choice)
            return ll.LLMatcher.grammar_from_lark(lark)
        try:
            return ll.grammar_from("grammar", params.grammar)  # Lark, or GBNF converted
        except ValueError as e:
            raise ValueError(f"structured_outputs.grammar is invalid: {e}") from None


def _json_options(params: StructuredOutputsParams) -> dict[str, Any]:
    """Whitespace and separators of generated JSON (see params.py for why it is bounded)."""
    if params.whitespace_pattern is not None:
        return {"whitespace_flexible": True, "whitespace_pattern": params.whitespace_pattern,
                "item_separator": ",", "key_separator": ":"}
    if params.disable_any_whitespace:
        return {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}
    return {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
