"""ReasoningConfig: how the engine knows a thinking model's reasoning (vLLM's
--reasoning-parser and --reasoning-config).

- `parser`: a reasoning parser's name (reasoning/parsers.py): its tags, and whether an
  answer without tags reasons (deepseek_r1) or not (qwen3). The server splits answers with it.
- `start_str` / `end_str` (--reasoning-config's reasoning_start_str / reasoning_end_str):
  the text that opens reasoning, and the text forced when a request's thinking_token_budget
  runs out (it may add a transition phrase before the parser's end tag, as in vLLM). Default:
  the parser's tags. Without a parser both are needed, and the end string is then also what
  ends reasoning naturally.

Data only: the strings become token ids where the tokenizer is (reasoning/gate.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tokenmill.reasoning.parsers import REASONING_PARSERS
from tokenmill.utils.json_option import json_object

_KEYS = {"reasoning_start_str", "reasoning_end_str"}


@dataclass(frozen=True)
class ReasoningConfig:
    parser: str | None = None
    start_str: str | None = None
    end_str: str | None = None

    def __post_init__(self) -> None:
        if self.parser is not None and self.parser not in REASONING_PARSERS:
            raise ValueError(f"unknown reasoning parser {self.parser!r}; known: "
                             f"{', '.join(sorted(REASONING_PARSERS))}")
        for name in ("start_str", "end_str"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"reasoning_config: reasoning_{name} must be a non-empty "
                                 f"string, got {value!r}")
        if self.parser is None and (self.start_str is None or self.end_str is None):
            raise ValueError("reasoning_config needs both reasoning_start_str and "
                             "reasoning_end_str without a reasoning parser "
                             "(--reasoning-parser gives them)")

    @property
    def tags(self) -> tuple[str, str, str]:
        """(start, natural end, forced end) as text."""
        parser = REASONING_PARSERS[self.parser] if self.parser is not None else None
        start = self.start_str or parser.start
        natural = parser.end if parser is not None else self.end_str
        return start, natural, self.end_str or natural

    @property
    def reasoning_without_tags(self) -> bool:
        """Whether an answer reasons from its first token, with or without the start tag."""
        return self.parser is not None and REASONING_PARSERS[self.parser].reasoning_without_tags

    @staticmethod
    def parse(parser: str | None, config: str | dict[str, Any] | None
              ) -> ReasoningConfig | None:
        """From --reasoning-parser and --reasoning-config's JSON; None: neither given."""
        if config is None:
            return None if parser is None else ReasoningConfig(parser)
        value = json_object(config, "reasoning_config")
        unknown = set(value) - _KEYS
        if unknown:
            raise ValueError(f"reasoning_config: unknown field(s) {', '.join(sorted(unknown))}; "
                             f"known: {', '.join(sorted(_KEYS))}")
        return ReasoningConfig(parser, value.get("reasoning_start_str"),
                               value.get("reasoning_end_str"))
