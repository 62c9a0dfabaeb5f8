"""The xgrammar backend (optional: `pip install tokenmill[xgrammar]`; on Linux xgrammar's own
requirements pull in triton, about 1 GB, which is why it is not the default).

Grammars are EBNF / GBNF (xgrammar has no Lark parser); JSON schema, regex and choice as with
llguidance. Matchers terminate when the grammar completes (`terminate_without_stop_token`), as
llguidance's stop, so a request ends the same way under either backend. xgrammar's
jump-forward gives a string: its tokens, less the last one (which might merge with the text
after it into another token), are the forced tokens.
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


class XGrammarMatcher(GrammarMatcher):
    def __init__(self, matcher: Any, tokenizer: Any) -> None:
        self._m, self._tokenizer = matcher, tokenizer
        self._error: str | None = None

    def accept(self, token_id: int) -> bool:
        ok = bool(self._m.accept_token(token_id))
        if not ok:
            self._error = f"token {token_id} is not allowed by the grammar"
        return ok

    def validate(self, token_ids: list[int]) -> int:
        n = 0
        for t in token_ids:
            if self._m.is_terminated() or not self._m.accept_token(t):
                break
            n += 1
        self._m.rollback(n)
        return n

    def rollback(self, num_tokens: int) -> None:
        if num_tokens:
            self._m.rollback(num_tokens)

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        self._m.fill_next_token_bitmask(bitmask, row)

    def forced_tokens(self) -> list[int]:
        text = self._m.find_jump_forward_string()
        if not text:
            return []
        ids = self._tokenizer.encode(text, add_special_tokens=False)[:-1]
        return ids[:self.validate(ids)]

    def is_terminated(self) -> bool:
        return bool(self._m.is_terminated())

    def error(self) -> str | None:
        return self._error


class XGrammarGrammar(CompiledGrammar):
    def __init__(self, compiled: Any, tokenizer: Any) -> None:
        self._compiled, self._tokenizer = compiled, tokenizer

    def matcher(self) -> XGrammarMatcher:
        import xgrammar as xgr

        m = xgr.GrammarMatcher(self._compiled, terminate_without_stop_token=True)
        return XGrammarMatcher(m, self._tokenizer)


class XGrammarBackend(StructuredOutputBackend):
    name = "xgrammar"

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: list[int]) -> None:
        import xgrammar as xgr

        self._tokenizer = tokenizer
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                  stop_token_ids=list(eos_token_ids))
        self._compiler = xgr.GrammarCompiler(info, max_threads=1)

    def compile(self, params: StructuredOutputsParams) -> XGrammarGrammar:
        kind = params.kind
        try:
            if kind in ("json", "json_object"):
                compiled = self._compile_json(params)
            elif kind == "regex":
                compiled = self._compiler.compile_regex(params.regex)
            elif kind == "choice":
                ebnf = "root ::= " + " | ".join(json.dumps(c) for c in params.choice)
                compiled = self._compiler.compile_grammar(ebnf)
            else:
                compiled = self._compiler.compile_grammar(params.grammar)
        except (RuntimeError, ValueError) as e:
            raise ValueError(f"structured_outputs.{kind} is invalid or unsupported: "
                             f"{e}") from None
        return XGrammarGrammar(compiled, self._tokenizer)

    def _compile_json(self, params: StructuredOutputsParams) -> Any:
        schema = json.dumps(json_schema_of(params))
        if params.whitespace_pattern is not None:
            raise ValueError("whitespace_pattern is not supported by the xgrammar backend")
        separators = (",", ":") if params.disable_any_whitespace else (", ", ": ")
        return self._compiler.compile_json_schema(schema, any_whitespace=False,
                                                  separators=separators)
