"""Pydantic models of chat: messages, tools and tool choice, /v1/chat/completions' request
(SamplingFields and its chat fields), and /tokenize's request, which may render a chat (and
/detokenize's beside it). Validated at the edge as protocol.py's models are."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, Literal

from pydantic import Field, StrictBool, StrictInt, model_validator

from tokenmill.sampling_params import SamplingParams
from tokenmill.server.protocol import SamplingFields, StrictModel, Text, TokenId


class TextPart(StrictModel):
    type: Literal["text"]
    text: Text


class FunctionCall(StrictModel):
    name: Text
    arguments: Text  # JSON text of an object


class MessageToolCall(StrictModel):
    id: Text
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(StrictModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Text | list[TextPart] | None = None
    name: Text | None = None
    tool_calls: list[MessageToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: Text | None = None  # a tool result: the call it answers
    # an assistant's earlier reasoning (vLLM's `reasoning`; `reasoning_content`, its older
    # name, as DeepSeek's API and Qwen's templates call it), shown to the template as both
    reasoning: Text | None = None
    reasoning_content: Text | None = None

    @model_validator(mode="after")
    def _tool_fields(self) -> ChatMessage:
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError("tool_calls is only allowed in assistant messages")
        if (self.reasoning is not None or self.reasoning_content is not None) \
                and self.role != "assistant":
            raise ValueError("reasoning is only allowed in assistant messages")
        if self.tool_call_id is not None and self.role != "tool":
            raise ValueError("tool_call_id is only allowed in tool messages")
        return self

    def for_template(self) -> dict[str, Any]:
        """The message as chat templates expect it: text parts joined (as vLLM does)."""
        content = self.content
        if isinstance(content, list):
            content = "\n".join(part.text for part in content)
        out: dict[str, Any] = {"role": self.role, "content": content}
        if self.name is not None:
            out["name"] = self.name
        if self.tool_calls is not None:
            out["tool_calls"] = [c.model_dump() for c in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        reasoning = self.reasoning if self.reasoning is not None else self.reasoning_content
        if reasoning is not None:
            out["reasoning"] = out["reasoning_content"] = reasoning
        return out


class FunctionDefinition(StrictModel):
    name: Annotated[str, Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")]
    description: Text | None = None
    parameters: dict[str, Any] | None = None
    strict: StrictBool | None = None


class ChatTool(StrictModel):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(StrictModel):
    name: Text


class NamedToolChoice(StrictModel):
    type: Literal["function"]
    function: FunctionName


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage]
    max_completion_tokens: StrictInt | None = None
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = None
    add_generation_prompt: StrictBool = True
    # (vLLM's) the last message left open for the model to continue (a prefilled answer)
    continue_final_message: StrictBool = False
    chat_template: Text | None = None  # (vLLM's) with --trust-request-chat-template
    documents: list[dict[str, Text]] | None = None  # (vLLM's) for a RAG chat template
    add_special_tokens: StrictBool = False  # (vLLM's) BOS etc. on top of the template's
    chat_template_kwargs: dict[str, Any] | None = None
    include_reasoning: StrictBool = True  # (vLLM's) with --reasoning-parser: false drops it
    # OpenAI's; for the chat template as vLLM passes it (reasoning_effort, and enable_thinking
    # false for "none" unless chat_template_kwargs sets it)
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh",
                              "max"] | None = None
    tools: list[ChatTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: StrictBool | None = None

    @model_validator(mode="after")
    def _one_ending(self) -> ChatCompletionRequest:
        if self.continue_final_message and self.add_generation_prompt:
            raise ValueError("continue_final_message must come with add_generation_prompt="
                             "false (the last message is continued, none is started)")
        return self

    def to_sampling_params(self, defaults: Mapping[str, Any] | None = None) -> SamplingParams:
        """`defaults`: the server's sampling defaults (ModelConfig.sampling_defaults)."""
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs must come with logprobs=true")
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        if logprobs is not None and logprobs < 0:  # (at most the engine's max_logprobs)
            raise ValueError(f"top_logprobs must be an integer >= 0, got {logprobs}")
        # (None: up to the context's end, or the model's max_new_tokens if less: the engine's
        # intake, which knows the prompt's length)
        max_tokens = (self.max_completion_tokens if self.max_completion_tokens is not None
                      else self.max_tokens)
        return self._sampling_params(max_tokens, logprobs, defaults or {})



class TokenizeRequest(StrictModel):
    model: Text | None = None
    prompt: Text | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: StrictBool = True
    add_generation_prompt: StrictBool = True


class DetokenizeRequest(StrictModel):
    model: Text | None = None
    tokens: list[TokenId]
