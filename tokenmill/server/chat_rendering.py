"""A chat request's conversation → the prompt: messages rendered with the chat template (the
request's own with --trust-request-chat-template, --chat-template's, else the tokenizer's),
their content in the template's format (engine/chat_content.py), tools shown to it (natively
or as a Hermes system message: server/tools.py), reasoning_effort and the request's
chat_template_kwargs passed as vLLM passes them. Also: whether a tag is a special token that
skip_special_tokens would drop from the answer's text (serving_chat.keep_markers asks).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

from tokenmill.engine.chat_content import as_content, content_format
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.engine.tokenizer import chat_template_of
from tokenmill.server.protocol_chat import ChatCompletionRequest, ChatMessage
from tokenmill.server.tools import conversation_with_tools, template_uses_tools


@dataclasses.dataclass(frozen=True)
class Rendering:
    """How a conversation becomes a prompt (a chat request's fields, vLLM's names)."""

    add_generation_prompt: bool = True
    continue_final: bool = False  # continue_final_message: the last message left open
    template: str | None = None  # the request's own chat_template (else the engine's)
    template_kwargs: dict[str, Any] | None = None  # chat_template_kwargs
    documents: list[dict[str, str]] | None = None  # for a RAG template (`documents`)
    add_special_tokens: bool = False  # the tokenizer's BOS etc. on top of the template's

    @classmethod
    def of(cls, req: ChatCompletionRequest) -> Rendering:
        return cls(req.add_generation_prompt, req.continue_final_message, req.chat_template,
                   with_effort(req.chat_template_kwargs, req.reasoning_effort), req.documents,
                   req.add_special_tokens)


def with_effort(kwargs: dict[str, Any] | None, effort: str | None) -> dict[str, Any] | None:
    """The chat template's keywords with a request's reasoning effort, as vLLM passes it:
    `reasoning_effort`, and `enable_thinking` (false for "none": Qwen3's and others'
    templates then render a closed, empty reasoning); the request's own keywords win."""
    if effort is None:
        return kwargs
    return {"reasoning_effort": effort, "enable_thinking": effort != "none"} | (kwargs or {})


def render_chat(engine: LLMEngine, messages: list[ChatMessage],
                how: Rendering = Rendering(), tools: list[dict[str, Any]] | None = None
                ) -> dict[str, Any]:
    """The prompt dict (text and token ids) for a conversation; ValueError if unusable."""
    tokenizer = engine.tokenizer
    template = how.template or chat_template_of(engine.config.model, tokenizer)
    if not template:
        raise ValueError("this model has no chat template (--chat-template gives one); use "
                         "/v1/completions")
    if not messages:
        raise ValueError("messages must not be empty")
    conversation = [m.for_template() for m in messages]
    kwargs = dict(how.template_kwargs or {})
    if how.documents is not None:
        if "documents" not in template:
            raise ValueError("documents is not supported by this model's chat template (it "
                             "renders none)")
        kwargs["documents"] = how.documents
    if tools or any("tool_calls" in m or m["role"] == "tool" for m in conversation):
        native = template_uses_tools(template)
        conversation = conversation_with_tools(conversation, tools or [], native)
        if native and tools:
            kwargs["tools"] = tools
    engine.check_text_length(sum(len(m["content"] or "") for m in conversation))
    fmt = content_format(template, engine.config.model.chat_template_content_format)
    conversation = [m | {"content": as_content(m["content"], fmt)} for m in conversation]
    try:
        text = tokenizer.apply_chat_template(
            conversation, chat_template=template, tokenize=False,
            add_generation_prompt=how.add_generation_prompt,
            continue_final_message=how.continue_final, **kwargs)
    except Exception as e:  # jinja errors for malformed conversations
        raise ValueError(f"messages cannot be rendered with the chat template: {e}") from e
    return {"prompt": text, "prompt_token_ids": tokenizer.encode(
        text, add_special_tokens=how.add_special_tokens)}


@functools.lru_cache(maxsize=64)
def skipped_on_decode(tokenizer: Any, text: str) -> bool:
    """Whether `text` is one special token, which decoding with skip_special_tokens drops."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    return len(ids) == 1 and tokenizer.decode(ids, skip_special_tokens=True) == ""
