"""OpenAI's Responses API request (`POST /v1/responses`, the subset vLLM serves) and its
translation onto the chat path (server/serving_chat.py): one implementation of templates,
tools, grammars and stop handling behind both APIs.

Served: `input` as a string or a list of items (messages with text parts, earlier
`function_call` and `function_call_output` items), `instructions`, `max_output_tokens`,
`temperature`, `top_p`, `tools` of type function with `tool_choice` (auto / none / required /
a named function) and `parallel_tool_calls`, `text.format` (text, json_object, json_schema),
`stream`, `reasoning.effort` (to the chat template, as chat's reasoning_effort; a summary is
refused: the reasoning comes whole; vLLM's `include_reasoning` false drops it), vLLM's
`structured_outputs`, earlier `reasoning` items (their text goes with the
assistant turn they preceded, as chat's `reasoning`). Responses are not stored: `store`
true and `previous_response_id` are refused by name, as is every other field.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, StrictBool, StrictInt

from tokenmill.server.protocol import Float, StrictModel, Text

_ROLES = ("user", "system", "developer", "assistant")


class ReasoningOptions(StrictModel):
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    # OpenAI's summaries are written by another model: the reasoning comes whole instead
    summary: None = None
    generate_summary: None = None


class ResponsesRequest(StrictModel):
    model: Text
    input: Text | list[dict[str, Any]]
    instructions: Text | None = None
    max_output_tokens: Annotated[StrictInt, Field(ge=1)] | None = None
    temperature: Annotated[Float, Field(ge=0)] | None = None
    top_p: Float | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["auto", "none", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: StrictBool | None = None
    text: dict[str, Any] | None = None
    stream: StrictBool = False
    reasoning: ReasoningOptions | None = None
    # vLLM's extras: a structured-output constraint (as chat's), and the reasoning dropped
    structured_outputs: dict[str, Any] | None = None
    include_reasoning: StrictBool = True
    store: Literal[False] | None = None  # nothing is stored: true is refused
    previous_response_id: None = None  # (no stored responses to continue from)

    def to_chat_request(self) -> dict[str, Any]:
        body: dict[str, Any] = {"model": self.model, "stream": self.stream,
                                "messages": chat_messages(self.instructions, self.input)}
        for name, value in (("max_tokens", self.max_output_tokens),
                            ("temperature", self.temperature), ("top_p", self.top_p),
                            ("parallel_tool_calls", self.parallel_tool_calls)):
            if value is not None:
                body[name] = value
        if self.tools:
            body["tools"] = [chat_tool(t, i) for i, t in enumerate(self.tools)]
        if self.tool_choice is not None:
            body["tool_choice"] = chat_tool_choice(self.tool_choice)
        if self.text is not None:
            body["response_format"] = response_format(self.text)
        if self.reasoning is not None and self.reasoning.effort is not None:
            body["reasoning_effort"] = self.reasoning.effort
        if self.structured_outputs is not None:
            if self.text is not None:
                raise ValueError("structured_outputs and text.format cannot be combined")
            body["structured_outputs"] = self.structured_outputs
        body["include_reasoning"] = self.include_reasoning
        return body


def chat_tool(tool: dict[str, Any], i: int) -> dict[str, Any]:
    if tool.get("type") != "function":
        raise ValueError(f"tools[{i}]: only tools of type function are served, got "
                         f"{tool.get('type')!r}")
    unknown = set(tool) - {"type", "name", "description", "parameters", "strict"}
    if unknown:
        raise ValueError(f"tools[{i}]: unknown field(s) {', '.join(sorted(unknown))}")
    return {"type": "function", "function": {k: tool[k] for k in
                                             ("name", "description", "parameters", "strict")
                                             if k in tool}}


def chat_tool_choice(choice: str | dict[str, Any]) -> Any:
    if isinstance(choice, str):
        return choice
    if choice.get("type") != "function" or not isinstance(choice.get("name"), str) \
            or set(choice) - {"type", "name"}:
        raise ValueError('tool_choice: "auto", "none", "required" or {"type": "function", '
                         '"name": ...}')
    return {"type": "function", "function": {"name": choice["name"]}}


def response_format(text: dict[str, Any]) -> dict[str, Any]:
    fmt = text.get("format")
    if set(text) - {"format"} or not isinstance(fmt, dict):
        raise ValueError('text: only {"format": {...}} is served')
    kind = fmt.get("type")
    if kind in ("text", "json_object") and set(fmt) == {"type"}:
        return {"type": kind}
    if kind == "json_schema":
        unknown = set(fmt) - {"type", "name", "schema", "description", "strict"}
        if unknown:
            raise ValueError(f"text.format: unknown field(s) {', '.join(sorted(unknown))}")
        return {"type": "json_schema", "json_schema": {k: v for k, v in fmt.items()
                                                       if k != "type"}}
    raise ValueError(f"text.format: type must be text, json_object or json_schema, got {kind!r}")


def _text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ValueError(f"{where}: content must be a string or a list of text parts")
    parts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") not in ("input_text", "output_text") \
                or not isinstance(part.get("text"), str):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise ValueError(f"{where}[{j}]: only input_text / output_text parts are served, "
                             f"got {kind!r}")
        parts.append(part["text"])
    return "\n".join(parts)


def chat_messages(instructions: str | None, items: str | list[dict[str, Any]]
                  ) -> list[dict[str, Any]]:
    """The conversation as chat messages: instructions as the system message, function calls
    as an assistant message's tool_calls (consecutive calls together), their outputs as tool
    messages."""
    out: list[dict[str, Any]] = []
    if instructions:
        out.append({"role": "system", "content": instructions})
    if isinstance(items, str):
        return out + [{"role": "user", "content": items}]
    reasoning: list[str] = []  # reasoning items' text, for the assistant turn after them
    for i, item in enumerate(items):
        where, kind = f"input[{i}]", item.get("type", "message")
        if kind == "reasoning":
            reasoning.append(_reasoning_text(item, where))
            continue
        if reasoning and not (kind == "function_call" or item.get("role") == "assistant"):
            raise ValueError(f"{where}: a reasoning item is followed by the assistant's "
                             "message or function call it led to")
        if kind == "message" and item.get("role") in _ROLES:
            out.append({"role": item["role"], "content": _text(item.get("content"), where)})
        elif kind == "function_call":
            if not all(isinstance(item.get(k), str) for k in ("call_id", "name", "arguments")):
                raise ValueError(f"{where}: a function_call has call_id, name and arguments")
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            if out and out[-1]["role"] == "assistant" and out[-1].get("tool_calls"):
                out[-1]["tool_calls"].append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str) or not isinstance(item.get("output"),
                                                                          str):
                raise ValueError(f"{where}: a function_call_output has call_id and output")
            out.append({"role": "tool", "tool_call_id": item["call_id"],
                        "content": item["output"]})
        else:
            raise ValueError(f"{where}: items of type {kind!r} (role "
                             f"{item.get('role')!r}) are not served")
        if reasoning:
            out[-1]["reasoning"], reasoning = "\n".join(reasoning), []
    if reasoning:
        raise ValueError("input: a reasoning item is followed by the assistant's message or "
                         "function call it led to")
    return out


def _reasoning_text(item: dict[str, Any], where: str) -> str:
    """An earlier reasoning item's text (its reasoning_text content, else its summary)."""
    unknown = set(item) - {"type", "id", "summary", "content", "encrypted_content", "status"}
    if unknown:
        raise ValueError(f"{where}: unknown field(s) of a reasoning item: "
                         f"{', '.join(sorted(unknown))}")
    if item.get("encrypted_content"):
        raise ValueError(f"{where}: encrypted reasoning cannot be read here; send its text as "
                         "content")
    parts = item.get("content") or item.get("summary") or []
    if not isinstance(parts, list) or not all(
            isinstance(p, dict) and p.get("type") in ("reasoning_text", "summary_text")
            and isinstance(p.get("text"), str) for p in parts):
        raise ValueError(f"{where}: a reasoning item's content is reasoning_text parts")
    return "\n".join(p["text"] for p in parts)
