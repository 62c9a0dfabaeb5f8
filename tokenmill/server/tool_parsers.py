"""Tool-call parsers: a model's text → (content, tool calls), chosen by `--tool-call-parser`
as in vLLM.

- `hermes` (Hermes 2 Pro, Qwen 2.5 / 3): each call is `<tool_call>{"name": ..., "arguments":
  {...}}</tool_call>`; the text outside the tags is the message content.
- `llama3_json` (Llama 3.1 / 3.2): the answer is one JSON object `{"name": ..., "parameters":
  {...}}` (or "arguments"), or several separated by ";", optionally after `<|python_tag|>`.
- `pythonic` (Llama 3.2 / 4 with a pythonic template): the answer is a Python list of calls
  with keyword arguments of literal values, `[get_weather(city="SF"), f(n=1)]`, optionally
  between `<|python_start|>` and `<|python_end|>`; read with `ast`, never evaluated.
- `mistral` (Mistral 7B v0.3, Mistral Small / Nemo): content, then `[TOOL_CALLS]` and a JSON
  array of {"name", "arguments"} (tokenizers before v11), or `[TOOL_CALLS]name[ARGS]{...}`
  once per call (v11 on).
- `granite` (Granite 3.x): content, then `<|tool_call|>` (3.0) or `<tool_call>` (3.1) and a
  JSON array of {"name", "arguments"}; text after the array is content too.
- `phi4_mini_json` (Phi-4-mini): `functools[{"name", "arguments"}, ...]`.
- `qwen3_coder` (Qwen3-Coder): `<tool_call><function=NAME><parameter=KEY>VALUE</parameter>
  ...</function></tool_call>`; each value is text, typed by the tool's JSON schema (strings
  kept, integers, numbers, booleans, null; objects and arrays read as JSON), as vLLM's.

A parser's `markers` are the texts that open its calls. Where one is a special token (Mistral's
`[TOOL_CALLS]`, Granite 3.0's `<|tool_call|>`), the answer is detokenized with its special
tokens (serving_chat.py, as vLLM's parsers ask): skipped, the marker would be lost.

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
from collections.abc import Callable
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
    markers: tuple[str, ...] = ()  # the texts that open a call (module doc)

    @abstractmethod
    def parse(self, text: str, tools: list[dict[str, Any]] | None = None
              ) -> tuple[str | None, list[ToolCall]]:
        """(content, or None when the answer is only calls; the calls). `tools`: the
        request's, as the template got them (a parser whose arguments are untyped text reads
        their schemas)."""

    def call_start(self, text: str) -> int | None:
        """Where in `text` a tool call begins or may begin once more text comes (None: no
        call can start within it): by default, where one of its markers does."""
        return _marker_start(text, self.markers)


class HermesToolParser(ToolParser):
    name = "hermes"
    OPEN, CLOSE = "<tool_call>", "</tool_call>"
    markers = (OPEN,)
    _CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)

    def parse(self, text: str, tools: list[dict[str, Any]] | None = None
              ) -> tuple[str | None, list[ToolCall]]:
        return _calls_between(text, self._CALL, self._call)

    @staticmethod
    def _call(m: re.Match[str]) -> ToolCall | None:
        try:
            return make_call(json.loads(m.group(1)))
        except json.JSONDecodeError:
            return None


def _calls_between(text: str, pattern: re.Pattern[str],
                   call_of: Callable[[re.Match[str]], ToolCall | None]
                   ) -> tuple[str | None, list[ToolCall]]:
    """(content, calls) of text whose calls are `pattern`'s matches (each made by `call_of`;
    a match it makes None of is not a call after all and stays in the content); the text
    between them is the content (None when there is none beside the calls)."""
    calls: list[ToolCall] = []
    content, last = [], 0
    for m in pattern.finditer(text):
        call = call_of(m)
        if call is None:
            continue
        calls.append(call)
        content.append(text[last:m.start()])
        last = m.end()
    content.append(text[last:])
    rest = "".join(content)
    return (rest if rest.strip() or not calls else None), calls


def _marker_start(text: str, markers: tuple[str, ...]) -> int | None:
    """Where the first of `markers` begins in `text`, or a tail that may grow into one (a
    partial "<tool_"); None: neither."""
    found = [i for m in markers if (i := text.find(m)) >= 0]
    if found:
        return min(found)
    for k in range(min(max(map(len, markers)) - 1, len(text)), 0, -1):
        if any(m.startswith(text[-k:]) for m in markers):
            return len(text) - k
    return None


def _json_calls(body: str) -> tuple[list[ToolCall], str] | None:
    """The calls of the JSON value `body` begins with (an array of {"name", "arguments"}
    objects, or one), and the text after it; None if that is not what it holds."""
    try:
        value, end = json.JSONDecoder().raw_decode(body)
    except json.JSONDecodeError:
        return None
    calls = [make_call(obj) for obj in (value if isinstance(value, list) else [value])]
    if not calls or None in calls:
        return None
    return calls, body[end:]


class MarkedJsonToolParser(ToolParser):
    """Content, then a marker and a JSON array of calls (granite, phi4_mini_json); what
    follows the array is content too."""

    def parse(self, text: str, tools: list[dict[str, Any]] | None = None
              ) -> tuple[str | None, list[ToolCall]]:
        found = [(i, m) for m in self.markers if (i := text.find(m)) >= 0]
        if not found:
            return text, []
        i, marker = min(found)
        got = _json_calls(text[i + len(marker):].lstrip())
        if got is None:
            return text, []
        calls, after = got
        rest = text[:i] + after
        return (rest if rest.strip() else None), calls


class GraniteToolParser(MarkedJsonToolParser):
    name = "granite"
    markers = ("<|tool_call|>", "<tool_call>")


class Phi4MiniJsonToolParser(MarkedJsonToolParser):
    name = "phi4_mini_json"
    markers = ("functools",)


class MistralToolParser(ToolParser):
    name = "mistral"
    MARKER, ARGS, CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"
    markers = (MARKER,)

    def parse(self, text: str, tools: list[dict[str, Any]] | None = None
              ) -> tuple[str | None, list[ToolCall]]:
        if self.MARKER not in text:
            return text, []
        content, *segments = text.split(self.MARKER)
        calls: list[ToolCall] = []
        for segment in filter(None, (seg.strip() for seg in segments)):
            got = (self._json(segment) if segment[0] in "[{" else self._named(segment))
            if got is None:
                return text, []  # not calls after all: all content
            calls += got
        if not calls:
            return text, []
        return (content if content.strip() else None), calls

    @staticmethod
    def _json(segment: str) -> list[ToolCall] | None:
        got = _json_calls(segment)
        return None if got is None or got[1].strip() else got[0]

    def _named(self, segment: str) -> list[ToolCall] | None:
        """`name[ARGS]{...}` (v11 on; `name[CALL_ID]id[ARGS]{...}` too)."""
        name, sep, args = segment.partition(self.ARGS)
        name = name.split(self.CALL_ID)[0].strip()
        try:
            value, end = json.JSONDecoder().raw_decode(args.strip())
        except json.JSONDecodeError:
            return None
        call = make_call({"name": name, "arguments": value}) if sep and name else None
        return None if call is None or args.strip()[end:].strip() else [call]


class Qwen3CoderToolParser(ToolParser):
    name = "qwen3_coder"
    markers = ("<tool_call>",)
    _CALL = re.compile(r"<tool_call>\s*<function=([^>\n]+)>(.*?)</function>\s*</tool_call>",
                       re.DOTALL)
    _PARAM = re.compile(r"<parameter=([^>\n]+)>(.*?)</parameter>", re.DOTALL)

    def parse(self, text: str, tools: list[dict[str, Any]] | None = None
              ) -> tuple[str | None, list[ToolCall]]:
        def call_of(m: re.Match[str]) -> ToolCall:
            name = m.group(1).strip()
            properties = _properties(tools, name)
            args = {key.strip(): _typed(_trim_newlines(value), properties.get(key.strip()))
                    for key, value in self._PARAM.findall(m.group(2))}
            return ToolCall(name, json.dumps(args, ensure_ascii=False), new_call_id())

        return _calls_between(text, self._CALL, call_of)


def _properties(tools: list[dict[str, Any]] | None, name: str) -> dict[str, Any]:
    """The JSON-schema properties of tool `name`'s parameters ({} if unknown)."""
    for tool in tools or []:
        fn = tool.get("function", tool)
        if fn.get("name") == name:
            return (fn.get("parameters") or {}).get("properties") or {}
    return {}


def _trim_newlines(value: str) -> str:
    """A parameter's value without the one newline the format puts on each side."""
    value = value[1:] if value.startswith("\n") else value
    return value[:-1] if value.endswith("\n") else value


def _typed(value: str, schema: dict[str, Any] | None) -> Any:
    """A parameter's text as the value its schema types (a string kept as written; no
    schema: JSON if it reads as JSON, else the text)."""
    kinds = (schema or {}).get("type")
    kinds = [k for k in (kinds if isinstance(kinds, list) else [kinds]) if k != "null"]
    kind = kinds[0] if kinds else None
    if kind == "string":
        return value
    if value.strip().lower() == "null":
        return None
    if kind == "boolean" and value.strip().lower() in ("true", "false"):
        return value.strip().lower() == "true"
    try:
        if kind == "integer":
            return int(value.strip())
        if kind == "number":
            number = float(value.strip())
            return int(number) if number.is_integer() and "." not in value else number
        return json.loads(value)
    except ValueError:
        return value


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"
    TAG = "<|python_tag|>"

    def parse(self, text: str, tools: list[dict[str, Any]] | None = None
              ) -> tuple[str | None, list[ToolCall]]:
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

    def parse(self, text: str, tools: list[dict[str, Any]] | None = None
              ) -> tuple[str | None, list[ToolCall]]:
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
    p.name: p for p in (HermesToolParser, Llama3JsonToolParser, PythonicToolParser,
                        MistralToolParser, GraniteToolParser, Phi4MiniJsonToolParser,
                        Qwen3CoderToolParser)}


def get_tool_parser(name: str) -> ToolParser:
    if name not in TOOL_PARSERS:
        raise ValueError(f"unknown tool call parser {name!r}; known: "
                         f"{', '.join(sorted(TOOL_PARSERS))}")
    return TOOL_PARSERS[name]()
