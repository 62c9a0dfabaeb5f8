"""Anthropic's Messages API request models (`POST /v1/messages`, `/v1/messages/count_tokens`)
and their translation onto the chat path (server/serving_chat.py): one implementation of
templates, tools, grammars and stop handling behind both APIs.

Served: `system` (a string or text blocks), `messages` with text, `tool_use` (assistant) and
`tool_result` (user) blocks, `max_tokens`, `stop_sequences`, `temperature`, `top_p`, `top_k`
(request fields; anthropic 2.x clients send them through extra_body), `stream`, `tools`
(name, description, input_schema) and `tool_choice` (auto / any / tool / none), `metadata`
(accepted; its user_id is not used), `cache_control` on the request and on blocks
(accepted: the prefix cache is automatic), `thinking` (as vLLM maps it: enabled → the
request's thinking_token_budget, with the template's enable_thinking; disabled → chat's
reasoning_effort "none"; adaptive → the model's own; display "omitted" drops the thinking
blocks, "summarized" returns them whole: nothing summarizes), and earlier `thinking` blocks
(their text goes back as the turn's reasoning; `redacted_thinking` blocks are opaque and
skipped, as vLLM does), `output_config` (effort → reasoning_effort; format json_schema → a
grammar-constrained answer). Anything else (images, documents, server tools, ...) is refused by
name.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field, StrictBool, StrictInt, model_validator

from tokenmill.server.protocol import Float, StrictModel, Text

_TEXT_KEYS = {"type", "text", "cache_control", "citations"}


class AnthropicErrorDetail(BaseModel):
    type: str
    message: str


class AnthropicErrorResponse(BaseModel):
    """Anthropic's error shape: {"type": "error", "error": {"type": ..., "message": ...}}."""

    type: Literal["error"] = "error"
    error: AnthropicErrorDetail


class AnthropicMessage(StrictModel):
    role: Literal["user", "assistant"]
    content: Text | list[dict[str, Any]]


class AnthropicTool(StrictModel):
    name: Annotated[str, Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")]
    description: Text | None = None
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None
    cache_control: dict[str, Any] | None = None


class ThinkingEnabled(StrictModel):
    type: Literal["enabled"]
    budget_tokens: Annotated[StrictInt, Field(ge=1024)]  # Anthropic's least
    display: Literal["summarized", "omitted"] | None = None


class ThinkingDisabled(StrictModel):
    type: Literal["disabled"]


class ThinkingAdaptive(StrictModel):
    type: Literal["adaptive"]
    display: Literal["summarized", "omitted"] | None = None


ThinkingConfig = Annotated[ThinkingEnabled | ThinkingDisabled | ThinkingAdaptive,
                           Field(discriminator="type")]


class OutputFormat(StrictModel):
    type: Literal["json_schema"]
    json_schema: dict[str, Any] = Field(alias="schema")


class OutputConfig(StrictModel):
    """Anthropic's output_config, as vLLM maps it: effort → chat's reasoning_effort, format
    → a JSON-schema response_format (grammar-constrained)."""

    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None
    format: OutputFormat | None = None


class CountTokensRequest(StrictModel):
    model: Text
    messages: list[AnthropicMessage]
    system: Text | list[dict[str, Any]] | None = None
    tools: list[AnthropicTool] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: ThinkingConfig | None = None
    output_config: OutputConfig | None = None

    def to_chat(self, **sampling: Any) -> dict[str, Any]:
        """The chat completions request (as JSON) this conversation is."""
        body: dict[str, Any] = {"model": self.model,
                                "messages": chat_messages(self.system, self.messages)}
        out = self.output_config
        if out is not None and out.effort is not None:
            body["reasoning_effort"] = out.effort
        if out is not None and out.format is not None:
            body["response_format"] = {"type": "json_schema", "json_schema": {
                "name": "output", "schema": out.format.json_schema}}
        if isinstance(self.thinking, ThinkingDisabled):  # (over output_config's effort)
            body["reasoning_effort"] = "none"
        elif isinstance(self.thinking, ThinkingEnabled):
            body["chat_template_kwargs"] = {"enable_thinking": True}
        if getattr(self.thinking, "display", None) == "omitted":
            body["include_reasoning"] = False
        if self.tools:
            body["tools"] = [{"type": "function", "function": {
                "name": t.name, "description": t.description, "parameters": t.input_schema}}
                for t in self.tools]
        if self.tool_choice is not None:
            body["tool_choice"] = chat_tool_choice(self.tool_choice)
        return body | sampling


class MessagesRequest(CountTokensRequest):
    max_tokens: Annotated[StrictInt, Field(ge=1)]
    stop_sequences: list[Text] | None = None
    temperature: Annotated[Float, Field(ge=0)] | None = None
    top_p: Float | None = None
    top_k: StrictInt | None = None
    stream: StrictBool = False
    metadata: dict[str, Any] | None = None
    cache_control: dict[str, Any] | None = None  # accepted: the prefix cache is automatic

    @model_validator(mode="after")
    def _budget_under_max_tokens(self) -> MessagesRequest:
        if isinstance(self.thinking, ThinkingEnabled) \
                and self.thinking.budget_tokens >= self.max_tokens:
            raise ValueError("thinking.budget_tokens must be less than max_tokens")
        return self

    def to_chat_request(self) -> dict[str, Any]:
        sampling = {"max_tokens": self.max_tokens, "stream": self.stream}
        if isinstance(self.thinking, ThinkingEnabled):
            sampling["thinking_token_budget"] = self.thinking.budget_tokens
        for name, value in (("stop", self.stop_sequences), ("temperature", self.temperature),
                            ("top_p", self.top_p), ("top_k", self.top_k)):
            if value is not None:
                sampling[name] = value
        return self.to_chat(**sampling)


def chat_tool_choice(choice: dict[str, Any]) -> Any:
    kind = choice.get("type")
    unknown = set(choice) - {"type", "name", "disable_parallel_tool_use"}
    if unknown:
        raise ValueError(f"tool_choice: unknown field(s) {', '.join(sorted(unknown))}")
    if kind == "tool":
        if not isinstance(choice.get("name"), str):
            raise ValueError('tool_choice {"type": "tool"} needs the tool\'s "name"')
        return {"type": "function", "function": {"name": choice["name"]}}
    mapped = {"auto": "auto", "any": "required", "none": "none"}.get(kind)
    if mapped is None:
        raise ValueError(f"tool_choice: type must be auto, any, tool or none, got {kind!r}")
    return mapped


def _text(block: dict[str, Any], where: str) -> str:
    unknown = set(block) - _TEXT_KEYS
    if unknown or not isinstance(block.get("text"), str):
        raise ValueError(f"{where}: a text block has a string `text` (and at most "
                         f"cache_control); got {', '.join(sorted(unknown)) or 'no text'}")
    return block["text"]


def _system_text(system: str | list[dict[str, Any]]) -> str:
    if isinstance(system, str):
        return system
    return "\n".join(_text(b, f"system[{i}]") for i, b in enumerate(system))


def _tool_result(block: dict[str, Any], where: str) -> dict[str, Any]:
    unknown = set(block) - {"type", "tool_use_id", "content", "is_error", "cache_control"}
    if unknown or not isinstance(block.get("tool_use_id"), str):
        raise ValueError(f"{where}: a tool_result block has tool_use_id, content and is_error"
                         + (f"; unknown: {', '.join(sorted(unknown))}" if unknown else ""))
    content = block.get("content") or ""
    if isinstance(content, list):
        content = "\n".join(_text(b, f"{where}.content[{j}]") for j, b in enumerate(content))
    if not isinstance(content, str):
        raise ValueError(f"{where}: content must be a string or text blocks")
    if block.get("is_error"):
        content = f"Error: {content}"
    return {"role": "tool", "tool_call_id": block["tool_use_id"], "content": content}


def _tool_use(block: dict[str, Any], where: str) -> dict[str, Any]:
    unknown = set(block) - {"type", "id", "name", "input", "cache_control"}
    if unknown or not isinstance(block.get("id"), str) or not isinstance(block.get("name"), str) \
            or not isinstance(block.get("input"), dict):
        raise ValueError(f"{where}: a tool_use block has an id, a name and an input object")
    return {"id": block["id"], "type": "function",
            "function": {"name": block["name"], "arguments": json.dumps(block["input"])}}


def chat_messages(system: str | list[dict[str, Any]] | None,
                  messages: list[AnthropicMessage]) -> list[dict[str, Any]]:
    """The conversation as chat completions messages: a system message, tool results as
    tool messages (before the user's text of the same turn), tool uses as tool_calls."""
    out: list[dict[str, Any]] = []
    if system:
        out.append({"role": "system", "content": _system_text(system)})
    for i, m in enumerate(messages):
        if isinstance(m.content, str):
            out.append({"role": m.role, "content": m.content})
            continue
        texts, calls, results, thoughts = [], [], [], []
        for j, block in enumerate(m.content):
            where, kind = f"messages[{i}].content[{j}]", block.get("type")
            if kind == "text":
                texts.append(_text(block, where))
            elif kind == "thinking" and m.role == "assistant":
                thoughts.append(_thinking(block, where))
            elif kind == "redacted_thinking" and m.role == "assistant":
                continue  # opaque (another model's, encrypted): nothing to show the template
            elif kind == "tool_use" and m.role == "assistant":
                calls.append(_tool_use(block, where))
            elif kind == "tool_result" and m.role == "user":
                results.append(_tool_result(block, where))
            else:
                raise ValueError(f"{where}: {m.role} content blocks of type {kind!r} are not "
                                 "supported (text, tool_use and thinking in assistant turns, "
                                 "tool_result in user turns)")
        out += results
        if texts or calls or not results:
            message: dict[str, Any] = {"role": m.role,
                                       "content": "\n".join(texts) if texts or not calls
                                       else None}
            if calls:
                message["tool_calls"] = calls
            if thoughts:
                message["reasoning"] = "\n".join(thoughts)
            out.append(message)
    return out


def _thinking(block: dict[str, Any], where: str) -> str:
    unknown = set(block) - {"type", "thinking", "signature", "cache_control"}
    if unknown or not isinstance(block.get("thinking"), str):
        raise ValueError(f"{where}: a thinking block has a string `thinking` (and its "
                         "signature)")
    return block["thinking"]
