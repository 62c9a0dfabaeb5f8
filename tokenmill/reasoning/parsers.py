"""--reasoning-parser (vLLM's): a thinking model's answer split into its reasoning (between
<think> and </think>) and its content, for chat completions (`message.reasoning`, streamed as
`delta.reasoning`, vLLM's field; a request's `include_reasoning: false` drops it).

- deepseek_r1: the reasoning comes first, whether or not the model wrote the opening tag (the
  chat template may hold it): all of an answer cut before </think> is reasoning.
- qwen3: an answer reasons when it opens <think> or its prompt did (a thinking template);
  otherwise it is all content (Qwen3 with thinking turned off), tags or not.

While streaming (`finished` False) a tail that may still grow into a tag is held back, in
neither part, so that no delta ever shows a piece of a tag. The split reads only the text,
as the tool parsers do (tool calls are then parsed out of the content).
"""

from __future__ import annotations

START, END = "<think>", "</think>"


def _held(text: str, tag: str) -> int:
    """How many characters at the end of `text` could begin `tag` (0: none)."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-k:]):
            return k
    return 0


class ReasoningParser:
    name = ""
    reasoning_without_tags = True  # an answer with neither tag: reasoning (R1) or content

    def split(self, text: str, finished: bool, opened: bool = False
              ) -> tuple[str | None, str]:
        """(reasoning or None, content) of an answer's text so far; `opened`: the prompt
        ends inside <think> (the chat template opened it: `prompt_opens_thinking`)."""
        stripped = text.lstrip()
        if not opened and not finished and START.startswith(stripped):
            return None, ""  # nothing yet, or the beginning of <think>: wait
        if not opened and stripped.startswith(START):
            opened, text = True, stripped[len(START):]
        if not (opened or self.reasoning_without_tags):
            return None, text  # an answer that does not think: all content
        if END in text:
            reasoning, _, content = text.partition(END)
            return reasoning, content
        return text[:len(text) - (0 if finished else _held(text, END))], ""


def prompt_opens_thinking(prompt: str) -> bool:
    """Whether a rendered prompt ends inside <think> (the answer then begins in reasoning)."""
    return prompt.rfind(START) > prompt.rfind(END)


class DeepSeekR1ReasoningParser(ReasoningParser):
    name = "deepseek_r1"


class Qwen3ReasoningParser(ReasoningParser):
    name = "qwen3"
    reasoning_without_tags = False


REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    p.name: p for p in (DeepSeekR1ReasoningParser, Qwen3ReasoningParser)}


def get_reasoning_parser(name: str) -> ReasoningParser:
    if name not in REASONING_PARSERS:
        raise ValueError(f"unknown reasoning parser {name!r}; known: "
                         f"{', '.join(sorted(REASONING_PARSERS))}")
    return REASONING_PARSERS[name]()
