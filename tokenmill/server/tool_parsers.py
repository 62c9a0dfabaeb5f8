"""Tool-call parsers: a model's text → (content, tool calls), chosen by `--tool-call-parser`
as in vLLM.

- `hermes` (Hermes 2 Pro, Qwen 2.5 / 3): each call is `<tool_call>{"name": ..., "arguments":
  {...}}</tool_call>`; the text outside the tags is the message content.
- `llama3_json` (Llama 3.1 / 3.2): the answer is one JSON object `{"name": ..., "parameters":
  {...}}` (or "arguments"), or several separated by ";", optionally after `<|python_tag|>`.
- `pythonic` (Llama 3.2 / 4 with a pythonic template): the answer is a Python list of calls
  with keyword arguments of literal values, `[get_weather(city="SF"), f(n=1)]`, optionally
  between `<|python_start|>` and `<|python_end|>`; read with `ast`, never evaluated.

Text that looks like a call but does not parse (a cut-off `<tool_call>`, invalid JSON, a
missing name) stays content: the client sees what the model said rather than a broken call.
`call_start` tells the streaming code where a call may begin, so it can hold back what might be
the start of one instead of streaming it as content.
"""

from __future__ import annotations

import ast
import json
import re
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text of an object, as the OpenAI API carries it
    id: str = ""

    def to_openai(self, index: int | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {"id": self.id or new_call_id(), "type": "function",
                               "function": {"name": self.name, "arguments": self.arguments}}
        if index is not None:
            out["index"] = index
        return out


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def make_call(obj: Any, args_keys: tuple[str, ...] = ("arguments", "parameters")
              ) -> ToolCall | None:
    """A ToolCall from a parsed {"name": ..., "arguments": {...}} object, or None."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = next((obj[k] for k in args_keys if k in obj), {})
    if isinstance(args, str):  # some models send the arguments already serialised
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False), new_call_id())


class ToolParser(ABC):
    name: str

    @abstractmethod
    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content, or None when the answer is only calls; the calls)."""

    @abstractmethod
    def call_start(self, text: str) -> int | None:
        """Where in `text` a tool call begins or may begin once more text comes (None: no
        call can start within it)."""


class HermesToolParser(ToolParser):
    name = "hermes"
    OPEN, CLOSE = "<tool_call>", "</tool_call>"
    _CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        calls: list[ToolCall] = []
        content, last = [], 0
        for m in self._CALL.finditer(text):
            try:
                call = make_call(json.loads(m.group(1)))
            except json.JSONDecodeError:
                call = None
            if call is None:
                continue  # not a call after all: stays in the content
            calls.append(call)
            content.append(text[last:m.start()])
            last = m.end()
        content.append(text[last:])
        rest = "".join(content)
        return (rest if rest.strip() or not calls else None), calls

    def call_start(self, text: str) -> int | None:
        i = text.find(self.OPEN)
        if i >= 0:
            return i
        for k in range(min(len(self.OPEN) - 1, len(text)), 0, -1):  # a partial "<tool_"
            if self.OPEN.startswith(text[-k:]):
                return len(text) - k
        return None


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"
    TAG = "<|python_tag|>"

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        body = text.strip()
        if body.startswith(self.TAG):
            body = body[len(self.TAG):].strip()
        if not body.startswith("{"):
            return text, []
        calls = []
        decoder = json.JSONDecoder()
        i = 0
        while i < len(body):
            try:
                obj, end = decoder.raw_decode(body, i)
            except json.JSONDecodeError:
                return text, []
            call = make_call(obj, ("parameters", "arguments"))
            if call is None:
                return text, []
            calls.append(call)
            i = end
            while i < len(body) and body[i] in " \t\r\n;":
                i += 1
        return None, calls

    def call_start(self, text: str) -> int | None:
        # the whole answer is calls or none is: hold it all while it may be one
        stripped = text.lstrip()
        if not stripped:
            return 0 if text else None  # only whitespace so far: wait for more
        if stripped.startswith(("{", self.TAG)) or self.TAG.startswith(stripped):
            return 0
        return None


class PythonicToolParser(ToolParser):
    name = "pythonic"
    START, END = "<|python_start|>", "<|python_end|>"  # (Llama 4 wraps its calls in them)

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        body = text.strip()
        body = body.removeprefix(self.START).removesuffix(self.END).strip()
        if not (body.startswith("[") and body.endswith("]")):
            return text, []
        try:
            tree = ast.parse(body, mode="eval").body
        except SyntaxError:
            return text, []
        calls = [_pythonic_call(node) for node in getattr(tree, "elts", [None])]
        if not isinstance(tree, ast.List) or not calls or None in calls:
            return text, []
        return None, calls

    def call_start(self, text: str) -> int | None:
        # the whole answer is calls or none is: hold it all while it may be one
        stripped = text.lstrip()
        if not stripped:
            return 0 if text else None
        if stripped.startswith(("[", self.START)) or self.START.startswith(stripped):
            return 0
        return None


def _pythonic_call(node: ast.expr | None) -> ToolCall | None:
    """`name(key=literal, ...)` as a ToolCall; None for anything else (positional or **
    arguments, a value that is not a literal or not JSON)."""
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and not node.args
            and all(kw.arg is not None for kw in node.keywords)):
        return None
    try:
        args = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords}
        return ToolCall(node.func.id, json.dumps(args, ensure_ascii=False), new_call_id())
    except (ValueError, TypeError, SyntaxError):  # not a literal, or a set / bytes
        return None


TOOL_PARSERS: dict[str, type[ToolParser]] = {
    p.name: p for p in (HermesToolParser, Llama3JsonToolParser, PythonicToolParser)}


def get_tool_parser(name: str) -> ToolParser:
    if name not in TOOL_PARSERS:
        raise ValueError(f"unknown tool call parser {name!r}; known: "
                         f"{', '.join(sorted(TOOL_PARSERS))}")
    return TOOL_PARSERS[name]()
