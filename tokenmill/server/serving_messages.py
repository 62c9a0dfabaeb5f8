"""POST /v1/messages and /v1/messages/count_tokens: Anthropic's Messages API as a thin
translation onto the chat path (serving_chat.py: the same template rendering, tool plan,
grammar constraint, stop handling and admission), answered in Anthropic's shapes:

- a message: `content` blocks (with --reasoning-parser a thinking block first, its signature
  an opaque id as vLLM's; text; then one tool_use per call with its parsed input),
  `stop_reason` end_turn / max_tokens / stop_sequence / tool_use, `usage` input / output
  tokens;
- a stream: message_start, then per block content_block_start, its deltas (thinking_delta
  then a signature_delta, text_delta, input_json_delta: a call's whole arguments at once,
  when the choice finishes) and content_block_stop, then message_delta (stop_reason, output
  tokens) and message_stop; an `error` event if the engine fails it after it began;
- errors: {"type": "error", "error": {"type": ..., "message": ...}} with Anthropic's types
  (invalid_request_error 400, authentication_error 401, not_found_error 404,
  rate_limit_error 429, api_error 500, overloaded_error 529 while the engine cannot serve).
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError

from tokenmill.engine.async_engine import EngineDeadError
from tokenmill.engine.llm_engine import EngineSleepingError
from tokenmill.outputs import CompletionOutput
from tokenmill.server.admission import Overloaded
from tokenmill.server.anthropic_protocol import CountTokensRequest, MessagesRequest
from tokenmill.server.lora_modules import UnknownModel
from tokenmill.server.protocol_chat import ChatCompletionRequest
from tokenmill.server.serving_chat import (
    AnswerShape,
    OpenAIServingChat,
    Started,
    answer,
    one_choice_deltas,
)
from tokenmill.server.serving_common import ChoiceSoFar, StreamedChoices

_ERRORS: list[tuple[type[BaseException], int, str]] = [
    (UnknownModel, 404, "not_found_error"),
    (ValueError, 400, "invalid_request_error"),  # includes pydantic's ValidationError
    (Overloaded, 429, "rate_limit_error"),
    (EngineDeadError, 529, "overloaded_error"),
    (EngineSleepingError, 529, "overloaded_error"),
]


def anthropic_error(status: int, kind: str, message: str) -> JSONResponse:
    return JSONResponse({"type": "error", "error": {"type": kind, "message": message}},
                        status_code=status)


def error_for(e: BaseException) -> JSONResponse:
    for cls, status, kind in _ERRORS:
        if isinstance(e, cls):
            return anthropic_error(status, kind, _message(e))
    return anthropic_error(500, "api_error", f"{type(e).__name__}: {e}")


def _message(e: BaseException) -> str:
    if isinstance(e, ValidationError):
        first = e.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        return f"{where}: {first['msg']}" if where else first["msg"]
    return str(e)


async def in_anthropic_shape(handle: Callable[[], Awaitable[Response]]) -> Response:
    """The handler's response, or its error in Anthropic's shape."""
    try:
        return await handle()
    except Exception as e:
        return error_for(e)


def stop_reason(c: CompletionOutput | ChoiceSoFar, finish: str | None
                ) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) of a finished choice."""
    if finish == "tool_calls":
        return "tool_use", None
    if finish == "length":
        return "max_tokens", None
    if isinstance(c.stop_reason, str):
        return "stop_sequence", c.stop_reason
    return "end_turn", None


def _event(kind: str, payload: dict[str, Any]) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **payload}, ensure_ascii=False)}\n\n"


class AnthropicServingMessages:
    def __init__(self, chat: OpenAIServingChat) -> None:
        self.chat = chat

    async def count_tokens(self, req: CountTokensRequest) -> dict[str, int]:
        chat_req = ChatCompletionRequest.model_validate(req.to_chat())
        _, prompt = await asyncio.get_running_loop().run_in_executor(
            None, self.chat.prepare, chat_req)
        return {"input_tokens": len(prompt["prompt_token_ids"])}

    async def create(self, req: MessagesRequest, raw: Request, lora: Any) -> Response:
        chat_req = ChatCompletionRequest.model_validate(req.to_chat_request())
        message = {"id": self.chat.response_id("msg"), "type": "message",
                   "role": "assistant", "model": self.chat.served_name(lora)}
        shape = self.chat.shape(chat_req)
        done = await self.chat.run(chat_req, raw, lora, lambda s, ticket: self._stream(
            message, s, shape, ticket))
        if isinstance(done, StreamingResponse):
            return done
        plan, final = done.plan, done.final
        c = final.outputs[0]
        content_only, reasoning = shape.split(c, True, shape.opens_thinking(final.prompt))
        chat_message, finish = answer(plan, content_only)
        content = ([{"type": "thinking", "thinking": reasoning, "signature": _signature()}]
                   if reasoning else [])
        if chat_message["content"]:
            content.append({"type": "text", "text": chat_message["content"]})
        content += [{"type": "tool_use", "id": call["id"], "name": call["function"]["name"],
                     "input": json.loads(call["function"]["arguments"])}
                    for call in chat_message.get("tool_calls", [])]
        reason, sequence = stop_reason(c, finish)
        return JSONResponse(message | {
            "content": content, "stop_reason": reason, "stop_sequence": sequence,
            "usage": {"input_tokens": len(final.prompt_token_ids),
                      "output_tokens": len(c.token_ids)}})

    async def _stream(self, message: dict[str, Any], started: Started, shape: AnswerShape,
                      ticket: Any) -> AsyncIterator[str]:
        blocks, streamed = _StreamedBlocks(), StreamedChoices()
        try:
            yield _event("message_start", {"message": message | {
                "content": [], "stop_reason": None, "stop_sequence": None,
                "usage": {"input_tokens": len(started.prompt["prompt_token_ids"]),
                          "output_tokens": 0}}})
            async for c, reasoning, delta, finish in one_choice_deltas(
                    started, shape, blocks.shown, streamed):
                for e in blocks.thinking(reasoning):
                    yield e
                for e in blocks.text(delta.get("content", "")):
                    yield e
                if finish is None:
                    continue
                for e in blocks.finish(delta.get("tool_calls", [])):
                    yield e
                reason, sequence = stop_reason(c, finish)
                yield _event("message_delta", {
                    "delta": {"stop_reason": reason, "stop_sequence": sequence},
                    "usage": {"output_tokens": c.num_tokens}})
            yield _event("message_stop", {})
        except Exception as e:  # the engine failed it, or died, after it began
            body = json.loads(error_for(e).body)
            yield _event("error", {"error": body["error"]})
        finally:
            ticket.release()


def _signature() -> str:
    """A thinking block's signature: opaque, as vLLM's (nothing here verifies it)."""
    return uuid.uuid4().hex


class _StreamedBlocks:
    """A streamed message's content blocks and their events, in order: thinking (closed with
    its signature when the text begins), text, then each call's tool_use."""

    def __init__(self) -> None:
        self.index, self.open = 0, None  # the block now open: "thinking", "text" or None
        self.thought = ""
        self.shown: dict[int, int] = {}  # the text's characters sent (delta's)

    def _close(self) -> list[str]:
        out = []
        if self.open == "thinking":
            out.append(_event("content_block_delta", {"index": self.index, "delta": {
                "type": "signature_delta", "signature": _signature()}}))
        if self.open is not None:
            out.append(_event("content_block_stop", {"index": self.index}))
            self.index, self.open = self.index + 1, None
        return out

    def thinking(self, reasoning: str) -> list[str]:
        new, out = reasoning[len(self.thought):], []
        if not new or self.open == "text":
            return out
        if self.open is None:
            self.open = "thinking"
            out.append(_event("content_block_start", {"index": self.index, "content_block": {
                "type": "thinking", "thinking": "", "signature": ""}}))
        self.thought = reasoning
        return out + [_event("content_block_delta", {"index": self.index, "delta": {
            "type": "thinking_delta", "thinking": new}})]

    def text(self, new: str) -> list[str]:
        if not new:
            return []
        out = [] if self.open == "text" else self._close()
        if self.open is None:
            self.open = "text"
            out.append(_event("content_block_start", {
                "index": self.index, "content_block": {"type": "text", "text": ""}}))
        return out + [_event("content_block_delta", {
            "index": self.index, "delta": {"type": "text_delta", "text": new}})]

    def finish(self, calls: list[dict[str, Any]]) -> list[str]:
        out = self._close()
        for call in calls:
            fn = call["function"]
            out += [_event("content_block_start", {"index": self.index, "content_block": {
                        "type": "tool_use", "id": call["id"], "name": fn["name"],
                        "input": {}}}),
                    _event("content_block_delta", {"index": self.index, "delta": {
                        "type": "input_json_delta", "partial_json": fn["arguments"]}}),
                    _event("content_block_stop", {"index": self.index})]
            self.index += 1
        return out
