"""--reasoning-parser (vLLM's): a thinking model's answer split into its reasoning (between
<think> and </think>) and its content: chat completions' `message.reasoning` (streamed as
`delta.reasoning`, vLLM's field; a request's `include_reasoning: false` drops it), the
Responses API's reasoning items and the Messages API's thinking blocks. The engine reads the
same tags as tokens (reasoning/gate.py: thinking budgets, grammars after the reasoning).

- deepseek_r1: the reasoning comes first, whether or not the model wrote the opening tag (the
  chat template may hold it): all of an answer cut before </think> is reasoning.
- qwen3: an answer reasons when it opens <think> or its prompt did (a thinking template);
  otherwise it is all content (Qwen3 with thinking turned off), tags or not.
- mistral (Magistral): as qwen3, between [THINK] and [/THINK].

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
    start, end = START, END  # the tags around the reasoning
    reasoning_without_tags = True  # an answer with neither tag: reasoning (R1) or content

    def split(self, text: str, finished: bool, opened: bool = False
              ) -> tuple[str | None, str]:
        """(reasoning or None, content) of an answer's text so far; `opened`: the prompt
        ends inside <think> (the chat template opened it: `prompt_opens`)."""
        stripped = text.lstrip()
        if not opened and not finished and self.start.startswith(stripped):
            return None, ""  # nothing yet, or the beginning of <think>: wait
        if not opened and stripped.startswith(self.start):
            opened, text = True, stripped[len(self.start):]
        if not (opened or self.reasoning_without_tags):
            return None, text  # an answer that does not think: all content
        if self.end in text:
            reasoning, _, content = text.partition(self.end)
            return reasoning, content
        return text[:len(text) - (0 if finished else _held(text, self.end))], ""


    def prompt_opens(self, prompt: str) -> bool:
        """Whether a rendered prompt ends inside the reasoning (the answer then begins in
        it)."""
        return prompt.rfind(self.start) > prompt.rfind(self.end)


class DeepSeekR1ReasoningParser(ReasoningParser):
    name = "deepseek_r1"


class Qwen3ReasoningParser(ReasoningParser):
    name = "qwen3"
    reasoning_without_tags = False


class MistralReasoningParser(ReasoningParser):
    """Magistral: [THINK] ... [/THINK] (special tokens from tokenizer v13: the server then
    keeps special tokens in the answer's text, serving_chat.keep_markers)."""

    name = "mistral"
    start, end = "[THINK]", "[/THINK]"
    reasoning_without_tags = False


REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    p.name: p for p in (DeepSeekR1ReasoningParser, Qwen3ReasoningParser,
                        MistralReasoningParser)}


def get_reasoning_parser(name: str) -> ReasoningParser:
    if name not in REASONING_PARSERS:
        raise ValueError(f"unknown reasoning parser {name!r}; known: "
                         f"{', '.join(sorted(REASONING_PARSERS))}")
    return REASONING_PARSERS[name]()
