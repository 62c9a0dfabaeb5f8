"""Tool calling (OpenAI `tools` / `tool_choice`) on top of the chat template, structured
outputs and the tool-call parsers.

- The chat template receives the tools (transformers' `apply_chat_template(tools=...)`). A
  template that never mentions `tools` (SmolLM2's, plain ChatML) would drop them silently: the
  tools then go into a system message in the Hermes format (Qwen 2.5's wording), earlier calls
  into the assistant turns as `<tool_call>` blocks and tool results as `<tool_response>`
  blocks, so the model sees every part of the conversation.
- `tool_choice`: "none" renders no tools and generates text; "auto" (the default with tools;
  it needs `--enable-auto-tool-choice` and `--tool-call-parser`, as in vLLM) generates freely
  and parses calls out of the text; "required" constrains the answer to a JSON array of
  {"name", "arguments"} objects, one of the tools each; a named function constrains it to that
  function's arguments. Constrained calls always validate against the tools' schemas.
- A tool whose parameters are not a JSON schema the grammar backend can compile is a 400
  before anything is scheduled.
- Constrained answers ("required", named) are calls, never text: an answer cut by max_tokens
  returns its complete calls (finish_reason "length") and drops the unfinished one.
  `parallel_tool_calls: false` allows one call: the "required" grammar ends the array after
  it (generation stops there); "auto" answers keep their first call (as vLLM filters them).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from tokenmill.server.tool_parsers import ToolCall, ToolParser, get_tool_parser, make_call
from tokenmill.structured_output.params import StructuredOutputsParams

HERMES_SYSTEM = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
    "{tools}\n</tools>\n\nFor each function call, return a json object with function name and "
    "arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{{\"name\": "
    "<function-name>, \"arguments\": <args-json-object>}}\n</tool_call>")


@dataclass(frozen=True)
class ToolOptions:
    """`tokenmill serve --enable-auto-tool-choice --tool-call-parser NAME` (vLLM's flags)."""

    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None

    def __post_init__(self) -> None:
        if self.tool_call_parser is not None:
            get_tool_parser(self.tool_call_parser)  # ValueError for an unknown name
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("--enable-auto-tool-choice needs --tool-call-parser")


@dataclass(frozen=True)
class ToolPlan:
    """What a chat request's tools mean for its generation and its answer."""

    mode: str  # "none" | "auto" | "required" | "named"
    tools: list[dict[str, Any]]  # the tools as the template gets them ([] for "none")
    constraint: StructuredOutputsParams | None  # required / named
    parser: ToolParser | None  # auto
    function: str | None = None  # named
    parallel: bool = True  # parallel_tool_calls: False allows one call

    def calls(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """The answer's (content, tool calls)."""
        if self.mode == "auto":
            content, calls = self.parser.parse(text, self.tools)
            return content, calls if self.parallel else calls[:1]
        if self.mode == "named":
            try:
                args = json.loads(text)
            except json.JSONDecodeError:
                return None, []  # cut off by max_tokens: no complete call
            call = make_call({"name": self.function, "arguments": args})
            return None, [call] if call else []
        if self.mode == "required":
            calls = [c for c in map(make_call, complete_array_items(text)) if c is not None]
            return None, calls
        return text, []


def plan_tools(tools: list[Any] | None, tool_choice: Any, parallel: bool | None,
               options: ToolOptions, compile_schema: Any) -> ToolPlan:
    """The plan for a request's `tools` (pydantic models, or None) and `tool_choice`;
    ValueError (a 400) for anything unusable. `compile_schema(params)` checks a schema."""
    defs = [t.function for t in tools or []]
    if not defs:
        if tool_choice not in (None, "none"):
            raise ValueError("tool_choice is only allowed with tools")
        return ToolPlan("none", [], None, None)
    names = [f.name for f in defs]
    if len(set(names)) != len(names):
        raise ValueError("tools must have distinct function names")
    schemas = {}
    for i, f in enumerate(defs):
        schema = f.parameters if f.parameters is not None else {"type": "object",
                                                               "properties": {}}
        if schema.get("type", "object") != "object":
            raise ValueError(f"tools[{i}].function.parameters must be a JSON schema of an "
                             f"object, got type {schema.get('type')!r}")
        try:
            compile_schema(StructuredOutputsParams(json=schema))
        except ValueError as e:
            raise ValueError(f"tools[{i}].function.parameters must be a JSON schema the "
                             f"grammar backend accepts: {e}") from None
        schemas[f.name] = schema
    rendered = [{"type": "function", "function": f.model_dump(exclude_none=True)}
                for f in defs]
    choice = "auto" if tool_choice is None else tool_choice
    if choice == "none":
        return ToolPlan("none", [], None, None)
    if choice == "auto":
        if not options.enable_auto_tool_choice:
            raise ValueError('tool_choice is not available as "auto" (the default with tools) '
                             "unless the server runs with --enable-auto-tool-choice and "
                             "--tool-call-parser")
        return ToolPlan("auto", rendered, None, get_tool_parser(options.tool_call_parser),
                        parallel=parallel is not False)
    if choice == "required":
        one_of = [{"type": "object", "properties": {"name": {"const": n},
                                                    "arguments": schemas[n]},
                   "required": ["name", "arguments"], "additionalProperties": False}
                  for n in names]
        array = {"type": "array", "minItems": 1, "items": {"anyOf": one_of}}
        if parallel is False:
            array["maxItems"] = 1
        return ToolPlan("required", rendered, StructuredOutputsParams(json=array), None)
    name = choice.function.name  # a named function
    if name not in schemas:
        raise ValueError(f"tool_choice must name one of the tools ({', '.join(names)}), "
                         f"got {name!r}")
    return ToolPlan("named", rendered, StructuredOutputsParams(json=schemas[name]), None, name)


def complete_array_items(text: str) -> list[Any]:
    """The complete values of a JSON array in `text`, which may be cut off anywhere (a
    constrained answer at max_tokens): '[{"a": 1}, {"b": [2' → [{"a": 1}]."""
    decoder = json.JSONDecoder()
    i = _skip_space(text, 0)
    if not text.startswith("[", i):
        return []
    items: list[Any] = []
    i += 1
    while True:
        i = _skip_space(text, i)
        if i >= len(text) or text[i] == "]":
            return items
        try:
            value, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError:
            return items  # the unfinished last item
        items.append(value)
        i = _skip_space(text, i)
        if not text.startswith(",", i):
            return items
        i += 1


def _skip_space(text: str, i: int) -> int:
    while i < len(text) and text[i] in " \t\n\r":
        i += 1
    return i


def template_uses_tools(template: str) -> bool:
    """Whether a chat template renders the tools itself (else they go in a system message)."""
    return "tools" in template


def conversation_with_tools(conversation: list[dict[str, Any]], tools: list[dict[str, Any]],
                            native: bool) -> list[dict[str, Any]]:
    """Messages for the template. `native`: the template renders tools, tool calls and tool
    results itself (arguments as objects, as HF templates expect); otherwise they become
    Hermes-format text (see the module doc)."""
    out = []
    for m in conversation:
        m = dict(m)
        calls = m.get("tool_calls")
        if calls:
            for c in calls:
                c["function"]["arguments"] = _as_object(c["function"]["arguments"])
            if not native:
                blocks = "\n".join("<tool_call>\n" + json.dumps(
                    {"name": c["function"]["name"], "arguments": c["function"]["arguments"]},
                    ensure_ascii=False) + "\n</tool_call>" for c in calls)
                m = {"role": "assistant",
                     "content": ((m.get("content") or "") + "\n" + blocks).lstrip("\n")}
        if m["role"] == "tool" and not native:
            m = {"role": "user",
                 "content": f"<tool_response>\n{m.get('content') or ''}\n</tool_response>"}
        out.append(m)
    if tools and not native:
        system = HERMES_SYSTEM.format(tools="\n".join(json.dumps(t, ensure_ascii=False)
                                                      for t in tools))
        if out and out[0]["role"] in ("system", "developer"):
            out[0] = {"role": "system", "content": f"{out[0]['content'] or ''}\n\n{system}"}
        else:
            out.insert(0, {"role": "system", "content": system})
    return out


def _as_object(arguments: Any) -> Any:
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except json.JSONDecodeError:
            return arguments
    return arguments
