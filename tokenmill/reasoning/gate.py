"""The engine's side of reasoning: a thinking budget, and a structured-output grammar that
starts where the reasoning ends (vLLM's thinking_token_budget and its grammars under a
reasoning parser).

`ReasoningTokens` holds the tags as token ids (from the engine's ReasoningConfig and
tokenizer). `gate` wraps a request's grammar, if it has one, in a `ReasoningGrammar`; each
sample gets a `ReasoningMatcher`, a GrammarMatcher (structured_output/backend.py) that the
scheduler advances on every token like any grammar. It walks four phases:

    UNDECIDED ──start tag──► THINKING ──end tag──────────────────► ANSWER
        │                       └─budget spent─► FORCING ─end forced─┘
        └─any other token──────────────────────────────────────────► ANSWER

- An answer begins THINKING when its prompt ends inside reasoning (a template that opens
  <think>; the prompt's reasoning tokens count against the budget) or when the parser reasons
  without tags (deepseek_r1); else UNDECIDED, where only the start tag leads to THINKING.
- THINKING allows every token; once the request has reasoned `budget` tokens it is FORCING:
  only the forced end's next token is allowed (it is also offered as forced tokens, which the
  scheduler appends without a step: jump-forward), after the part of it the model wrote itself.
- ANSWER is the request's own grammar (JSON schema, tool calls, ...), or anything without one.

Invariants: the matcher's state is a function of the tokens accepted (rollback restores it
exactly, drafts included); without a budget or a grammar no request is gated (`gate` returns
None), so a plain request keeps async scheduling and its drafts; a budget alone keeps the
step ahead too, except at the step that may spend it and while the end is forced
(`decided_ahead`); and only the forced end and a grammar's answer take a token mask
(`constrains`): a step of free reasoning costs no mask.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from tokenmill.reasoning.config import ReasoningConfig
from tokenmill.structured_output.backend import CompiledGrammar, GrammarMatcher

UNDECIDED, THINKING, FORCING, ANSWER = range(4)


@dataclass(frozen=True)
class ReasoningTokens:
    start: tuple[int, ...]
    end: tuple[int, ...]  # ends reasoning when the model writes it
    forced_end: tuple[int, ...]  # written for the model when its budget runs out
    without_tags: bool  # an answer reasons from its first token (deepseek_r1)
    grammar_in_reasoning: bool = False  # structured outputs' enable_in_reasoning: no gate

    @classmethod
    def of(cls, config: ReasoningConfig, tokenizer: Any,
           grammar_in_reasoning: bool = False) -> ReasoningTokens:
        ids = []
        for text in config.tags:
            tokens = tuple(tokenizer.encode(text, add_special_tokens=False))
            if not tokens:
                raise ValueError(f"reasoning: {text!r} is no token of this tokenizer")
            ids.append(tokens)
        return cls(*ids, config.reasoning_without_tags, grammar_in_reasoning)

    def prompt_reasoning(self, prompt: list[int]) -> int | None:
        """How many reasoning tokens the prompt ends with, after its last start tag (None:
        the prompt does not end inside reasoning)."""
        start, end = _last(prompt, self.start), _last(prompt, self.end)
        if start < 0 or end > start:
            return None
        return len(prompt) - start - len(self.start)

    def count(self, prompt: list[int], answer: list[int]) -> int:
        """How many of the answer's tokens are reasoning, its tags included (the Responses
        API's reasoning_tokens): up to the first end tag, or all of them while it reasons."""
        if self.prompt_reasoning(prompt) is None and not self.without_tags \
                and tuple(answer[:len(self.start)]) != self.start:
            return 0
        n, first = len(self.end), self.end[0]
        return next((i + n for i in range(len(answer) - n + 1)
                     if answer[i] == first and tuple(answer[i:i + n]) == self.end),
                    len(answer))

    def gate(self, grammar: CompiledGrammar | None, budget: int | None,
             prompt: list[int]) -> CompiledGrammar | None:
        """The grammar a request runs with: `grammar` from where its reasoning ends, with the
        thinking `budget`; `grammar` itself when nothing needs a gate."""
        if budget is None and (grammar is None or self.grammar_in_reasoning):
            return grammar
        if grammar is not None and self.grammar_in_reasoning:
            raise ValueError("thinking_token_budget cannot be combined with a structured "
                             "output while the engine applies grammars in the reasoning "
                             "(structured_outputs_config enable_in_reasoning)")
        in_prompt = self.prompt_reasoning(prompt)
        if in_prompt is not None:
            phase, count = THINKING, in_prompt
        else:
            phase, count = (THINKING if self.without_tags else UNDECIDED), 0
        return ReasoningGrammar(self, grammar, budget, phase, count)


def _last(tokens: list[int], seq: tuple[int, ...]) -> int:
    """Where `seq` last begins in `tokens` (-1: nowhere)."""
    n, first = len(seq), seq[0]
    for i in range(len(tokens) - n, -1, -1):
        if tokens[i] == first and tuple(tokens[i:i + n]) == seq:  # (no slice per position)
            return i
    return -1


@dataclass(frozen=True)
class ReasoningGrammar(CompiledGrammar):
    tokens: ReasoningTokens
    inner: CompiledGrammar | None
    budget: int | None
    phase: int
    count: int  # reasoning tokens already in the prompt

    def matcher(self) -> ReasoningMatcher:
        return ReasoningMatcher(self.tokens, None if self.inner is None
                                else self.inner.matcher(), self.budget, self.phase, self.count)


class ReasoningMatcher(GrammarMatcher):
    def __init__(self, tokens: ReasoningTokens, inner: GrammarMatcher | None,
                 budget: int | None, phase: int, count: int) -> None:
        self.t, self.inner, self.budget = tokens, inner, budget
        self.phase, self.count = phase, count
        # UNDECIDED: the start tag's tokens written so far; THINKING: the latest tokens (to
        # find the end tag); FORCING: how much of the forced end is written
        self.recent: tuple[int, ...] = ()
        self.forced = 0
        self._keep = max(len(tokens.end), len(tokens.forced_end))
        self._history: list[tuple[int, int, tuple[int, ...], int, int]] = []
        self._check_budget()

    # ---- GrammarMatcher ---------------------------------------------------------------------
    def accept(self, token_id: int) -> bool:
        state = (self.phase, self.count, self.recent, self.forced)
        inner_accepted = self._advance(token_id)
        if inner_accepted is None:
            self.phase, self.count, self.recent, self.forced = state
            return False
        self._history.append((*state, inner_accepted))
        return True

    def validate(self, token_ids: list[int]) -> int:
        n = 0
        for token_id in token_ids:
            if not self.accept(token_id):
                break
            n += 1
        self.rollback(n)
        return n

    def rollback(self, num_tokens: int) -> None:
        for _ in range(num_tokens):
            self.phase, self.count, self.recent, self.forced, inner = self._history.pop()
            if inner:
                self.inner.rollback(inner)

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        if self.phase == FORCING:
            bitmask[row] = 0
            _allow(bitmask, row, self.t.forced_end[self.forced])
        elif self.inner is None or self.phase == THINKING:
            bitmask[row] = -1
        elif self.phase == ANSWER:
            self.inner.fill_bitmask(bitmask, row)
        else:  # UNDECIDED: the grammar after what was written, or the start tag's next token
            fed = self._feed(self.recent)
            if fed is None:
                bitmask[row] = 0
            else:
                self.inner.fill_bitmask(bitmask, row)
                self.inner.rollback(fed)
            _allow(bitmask, row, self.t.start[len(self.recent)])

    def forced_tokens(self) -> list[int]:
        if self.phase == FORCING:
            return list(self.t.forced_end[self.forced:])
        if self.phase == ANSWER and self.inner is not None:
            return self.inner.forced_tokens()
        return []

    def is_terminated(self) -> bool:
        return self.phase == ANSWER and self.inner is not None and self.inner.is_terminated()

    def error(self) -> str | None:
        return None if self.inner is None else self.inner.error()

    def constrains(self) -> bool:
        """Reasoning is free (no mask), and so is an answer without a grammar."""
        return self.phase == FORCING or (self.inner is not None and self.phase != THINKING)

    def decided_ahead(self) -> bool:
        """Without a grammar, the mask after any one more token is all tokens unless that
        token may spend the budget (or the end is being forced): the request keeps its step
        ahead under async scheduling until the last reasoning token."""
        if self.inner is not None or self.phase == FORCING:
            return False
        if self.phase == ANSWER or self.budget is None:
            return True
        if self.phase == THINKING:
            return self.count + 1 < self.budget
        return self.budget >= 1  # UNDECIDED: at most the start tag's end, a count of 0

    # ---- the phases -------------------------------------------------------------------------
    def _advance(self, token_id: int) -> int | None:
        """Take one token: how many tokens the inner grammar accepted with it (None: refused)."""
        if self.phase == UNDECIDED:
            if token_id == self.t.start[len(self.recent)]:
                self.recent += (token_id,)
                if len(self.recent) == len(self.t.start):
                    self.phase, self.count, self.recent = THINKING, 0, ()
                    self._check_budget()
                return 0
            written, self.phase, self.recent = self.recent + (token_id,), ANSWER, ()
            return self._feed(written)
        if self.phase == THINKING:
            self.count += 1
            self.recent = (self.recent + (token_id,))[-self._keep:]
            if self.recent[-len(self.t.end):] == self.t.end:
                self.phase, self.recent = ANSWER, ()
            else:
                self._check_budget()
            return 0
        if self.phase == FORCING:
            if token_id != self.t.forced_end[self.forced]:
                return None
            self.forced += 1
            if self.forced == len(self.t.forced_end):
                self.phase = ANSWER
            return 0
        return self._feed((token_id,))

    def _feed(self, tokens: tuple[int, ...]) -> int | None:
        """`tokens` into the inner grammar: how many (None, and none kept: refused)."""
        if self.inner is None:
            return 0
        # checked first: a grammar library's matcher may be left broken by a refused token
        if self.inner.validate(list(tokens)) < len(tokens):
            return None
        for token_id in tokens:
            self.inner.accept(token_id)
        return len(tokens)

    def _check_budget(self) -> None:
        """THINKING past the budget: FORCING, after the part of the forced end the model
        wrote itself."""
        if self.phase != THINKING or self.budget is None or self.count < self.budget:
            return
        end = self.t.forced_end
        self.phase, self.forced = FORCING, next(
            (k for k in range(min(len(end) - 1, len(self.recent)), 0, -1)
             if self.recent[-k:] == end[:k]), 0)


def _allow(bitmask: torch.Tensor, row: int, token_id: int) -> None:
    """Set token_id's bit in row `row` (int32 words: bit 31 is the sign)."""
    word, bit = divmod(token_id, 32)
    value = int(bitmask[row, word]) | (1 << bit)
    bitmask[row, word] = value - (1 << 32) if value >= 1 << 31 else value
