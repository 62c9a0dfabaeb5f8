"""Incremental detokenization: text grows token by token without ever holding half a character.

Byte-level BPE can split one UTF-8 character over several tokens, and SentencePiece decodes a
token differently depending on what precedes it. A fast tokenizer (a `tokenizers` Tokenizer
behind transformers' class) does this in Rust with `tokenizers.decoders.DecodeStream`, which
keeps its own window of ids and yields a token's text once it completes characters (vLLM's
fast path: ~0.7 µs a token where decoding the window twice in Python took ~6, a cost the
engine pays for every running request at every step). Other tokenizers decode a short window
of ids twice, with and without the newest ones, and emit the difference only once it no
longer ends in the replacement character U+FFFD. Either way the window starts with a few
prompt tokens for context: for the stream, the shortest suffix of 4 or more (up to 24) that
decodes whole, so that no half character of the prompt leaks into the output.
"""

from __future__ import annotations

from typing import Any

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], skip_special_tokens: bool,
                 spaces_between_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.spaces_between_special_tokens = spaces_between_special_tokens
        self.text = ""
        self.num_output_tokens = 0  # output tokens consumed so far
        backend = getattr(tokenizer, "_tokenizer", None)
        self._rust: Tokenizer | None = backend if isinstance(backend, Tokenizer) else None
        if self._rust is not None:
            self._context = _whole_suffix(tokenizer, prompt_token_ids)
            self._stream = self._primed_stream()
            return
        self._ids = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)

    def add_tokens(self, token_ids: list[int]) -> str:
        """Append new output tokens; return the text they completed (possibly empty)."""
        self.num_output_tokens += len(token_ids)
        delta = self._stream_add(token_ids) if self._rust is not None else \
            self._window_add(token_ids)
        self.text += delta
        return delta

    def _stream_add(self, token_ids: list[int]) -> str:
        parts = []
        for t in token_ids:
            try:
                piece = self._stream.step(self._rust, t)
            except Exception:  # a prefix the decoder refuses: start again from the prompt's
                self._stream = self._primed_stream()
                piece = self._stream.step(self._rust, t)
            if piece is not None:
                parts.append(piece)
        return "".join(parts)

    def _primed_stream(self) -> DecodeStream:
        stream = DecodeStream(skip_special_tokens=self.skip_special_tokens)
        for t in self._context:
            stream.step(self._rust, t)
        return stream

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(
            ids, skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens)

    def _window_add(self, token_ids: list[int]) -> str:
        self._ids.extend(token_ids)
        prefix = self._decode(self._ids[self._prefix_offset:self._read_offset])
        full = self._decode(self._ids[self._prefix_offset:])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            delta = full[len(prefix):]
            self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
            return delta
        return ""


def _whole_suffix(tokenizer: Any, prompt_token_ids: list[int]) -> list[int]:
    """The prompt's shortest suffix of 4+ tokens (at most 24) that decodes to whole characters,
    less a character the prompt leaves unfinished at its end (its bytes are no context: the
    output does not continue them); none when no suffix does."""
    end = len(prompt_token_ids)
    while end and tokenizer.decode(prompt_token_ids[max(0, end - 4):end]).endswith("\ufffd"):
        end -= 1
    for n in range(min(4, end), min(end, 24) + 1):
        suffix = prompt_token_ids[end - n:end]
        if "\ufffd" not in tokenizer.decode(suffix):
            return list(suffix)
    return []
