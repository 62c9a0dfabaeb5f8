"""Incremental detokenization: text grows token by token without ever holding half a character.

Byte-level BPE can split one UTF-8 character over several tokens, and SentencePiece decodes a
token differently depending on what precedes it. So we decode a short window of ids twice,
with and without the newest ones, and emit the difference only once it no longer ends in the
replacement character U+FFFD. The window starts with a few prompt tokens for context.
"""

from __future__ import annotations

from typing import Any

_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], skip_special_tokens: bool,
                 spaces_between_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.spaces_between_special_tokens = spaces_between_special_tokens
        self._ids = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self.text = ""
        self.num_output_tokens = 0  # output tokens consumed so far

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(
            ids, skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens)

    def add_tokens(self, token_ids: list[int]) -> str:
        """Append new output tokens; return the text they completed (possibly empty)."""
        self._ids.extend(token_ids)
        self.num_output_tokens += len(token_ids)
        prefix = self._decode(self._ids[self._prefix_offset:self._read_offset])
        full = self._decode(self._ids[self._prefix_offset:])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            delta = full[len(prefix):]
            self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
            self.text += delta
            return delta
        return ""
