"""Anthropic's routes: `POST /v1/messages` and `POST /v1/messages/count_tokens`
(serving_messages.py), keyed by `x-api-key` (Anthropic's header) or `Authorization: Bearer`,
every error in Anthropic's shape (a body that fails validation too: routes.py answers
RequestValidationError on these paths in it)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from tokenmill.server.anthropic_protocol import (
    AnthropicErrorResponse,
    CountTokensRequest,
    MessagesRequest,
)
from tokenmill.server.protocol import ErrorResponse
from tokenmill.server.serving_common import STREAMED
from tokenmill.server.serving_messages import (
    AnthropicServingMessages,
    anthropic_error,
    in_anthropic_shape,
)

PREFIX = "/v1/messages"
router = APIRouter(prefix="/v1")

# Errors these routes answer themselves are Anthropic's; the server's edge (middleware.py:
# 413, 429 before the body is read, 503 while draining) answers in OpenAI's shape.
_RESPONSES: dict[int | str, dict[str, Any]] = {
    code: {"model": AnthropicErrorResponse, "description": text} for code, text in [
        (400, "Invalid request"), (401, "Invalid API key"), (404, "Unknown model"),
        (500, "The engine failed the request"), (529, "Engine dead or asleep")]} | {
    429: {"model": AnthropicErrorResponse | ErrorResponse, "description": "Overloaded"}}
_STREAMED = _RESPONSES | STREAMED


def _authorized(raw: Request) -> bool:
    key = raw.app.state.server.api_key
    return (not key or raw.headers.get("x-api-key") == key
            or raw.headers.get("authorization") == f"Bearer {key}")


async def _serve(raw: Request, model: str,
                 handle: Callable[[AnthropicServingMessages, Any], Awaitable[Response]]
                 ) -> Response:
    """The key checked, `model` resolved (a LoRA adapter or the served model), then
    handle(serving, adapter); every error in Anthropic's shape."""
    async def keyed() -> Response:
        if not _authorized(raw):
            return anthropic_error(401, "authentication_error", "invalid or missing API key")
        s = raw.app.state.server
        return await handle(AnthropicServingMessages(s.chat), s.adapters.resolve(model))
    return await in_anthropic_shape(keyed)


@router.post("/messages", responses=_STREAMED)
async def create_message(req: MessagesRequest, raw: Request) -> Response:
    return await _serve(raw, req.model, lambda serving, lora: serving.create(req, raw, lora))


@router.post("/messages/count_tokens", responses=_RESPONSES)
async def count_tokens(req: CountTokensRequest, raw: Request) -> Response:
    async def count(serving: AnthropicServingMessages, _: Any) -> Response:
        return JSONResponse(await serving.count_tokens(req))
    return await _serve(raw, req.model, count)
