"""The server's routes and error handlers, over the state `build_app` puts on the app.

Each route reads what it serves with from `request.app.state.server` (ServerState), so the
routes are plain module-level functions on three routers: `public` (/health, /version,
/metrics: never behind the API key), `v1` (the OpenAI routes) and `keyed` (/tokenize,
/detokenize: behind the key, outside /v1 as in vLLM). Every error leaves in OpenAI's shape
(serving_common.error_response), by the handler of its exception in EXCEPTION_HANDLERS.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from tokenmill import __version__
from tokenmill.engine.async_engine import AsyncLLM, EngineDeadError
from tokenmill.engine.data_parallel import DataParallelLLM
from tokenmill.engine.llm_engine import EngineSleepingError, LLMEngine
from tokenmill.metrics.prometheus import PrometheusMetrics
from tokenmill.server.admission import RETRY_AFTER_S, Overloaded
from tokenmill.server.chat_rendering import Rendering, render_chat
from tokenmill.server.lifecycle import ServerLifecycle
from tokenmill.server.lora_modules import ServedAdapters, UnknownModel
from tokenmill.server.messages_routes import PREFIX as ANTHROPIC_PREFIX
from tokenmill.server.protocol import CompletionRequest, ModelCard
from tokenmill.server.protocol_chat import (
    ChatCompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from tokenmill.server.responses_protocol import ResponsesRequest
from tokenmill.server.serving_chat import OpenAIServingChat
from tokenmill.server.serving_common import (
    STREAMED,
    ClientDisconnected,
    RequestFailed,
    error_response,
)
from tokenmill.server.serving_completion import OpenAIServingCompletion
from tokenmill.server.serving_embedding import EmbeddingRequest, OpenAIServingEmbedding
from tokenmill.server.serving_messages import anthropic_error
from tokenmill.server.serving_responses import OpenAIServingResponses

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServerState:
    """What the routes serve with (app.state.server)."""

    engine: LLMEngine  # replica 0's: tokenizer and config, which the replicas share
    async_llm: AsyncLLM | DataParallelLLM
    lifecycle: ServerLifecycle
    metrics: PrometheusMetrics
    served_model_name: str
    api_key: str | None
    completions: OpenAIServingCompletion
    chat: OpenAIServingChat
    embeddings: OpenAIServingEmbedding
    adapters: ServedAdapters  # the LoRA adapters served by name (a request's `model`)


def _state(request: Request) -> ServerState:
    return request.app.state.server


class Unauthorized(Exception):
    pass


async def check_api_key(request: Request) -> None:
    # NOTE: a dependency, not BaseHTTPMiddleware, which hides client disconnects from
    # streaming responses.
    api_key = _state(request).api_key
    if api_key and request.headers.get("authorization") != f"Bearer {api_key}":
        raise Unauthorized


public = APIRouter()
v1 = APIRouter(prefix="/v1", dependencies=[Depends(check_api_key)])
keyed = APIRouter(dependencies=[Depends(check_api_key)])


@public.get("/health", response_class=Response,
            responses={200: {"description": "Healthy (empty body)", "content": {}}})
async def health(raw: Request) -> Response:
    s = _state(raw)
    if s.async_llm.dead_error is not None:
        return error_response(503, f"the engine is dead: {s.async_llm.dead_error}")
    if s.lifecycle.draining or not s.async_llm.is_running:
        return error_response(503, "the server is shutting down")
    if s.async_llm.is_sleeping:  # alive; generation answers 503 until POST /wake_up
        return JSONResponse({"status": "sleeping"})
    if s.metrics.disk_tier_available is False:  # serving, without its disk tier
        return JSONResponse({"status": "degraded", "kv_offloading_disk": "unavailable: a "
                             "block write failed (a full disk?); no more blocks are written"})
    return Response(status_code=200)


@public.api_route("/ping", methods=["GET", "POST"], response_class=Response,
                  responses={200: {"description": "Healthy (empty body)", "content": {}}})
async def ping(raw: Request) -> Response:
    """SageMaker's health route (vLLM serves it too): /health's answer."""
    return await health(raw)


@public.get("/version")
async def version() -> dict[str, str]:
    return {"version": __version__}


@public.get("/metrics", response_class=Response, responses={200: {
    "description": "Prometheus text format", "content": {"text/plain": {}}}})
async def prometheus_metrics(raw: Request) -> Response:
    return Response(_state(raw).metrics.render(), media_type=CONTENT_TYPE_LATEST)


@v1.get("/models")
async def models(raw: Request) -> dict[str, Any]:
    """The served model, then each LoRA adapter with the model as its parent (vLLM's)."""
    s = _state(raw)
    max_len = s.engine.config.model.max_model_len
    cards = [ModelCard(id=name, root=s.served_model_name, max_model_len=max_len)
             for name in s.adapters.base_names]
    cards += [ModelCard(id=a.lora_name, root=a.lora_path, parent=s.served_model_name,
                        max_model_len=max_len) for a in s.adapters.all()]
    return {"object": "list", "data": [c.model_dump() for c in cards]}


@v1.post("/completions", responses=STREAMED)
async def create_completion(req: CompletionRequest, raw: Request) -> Any:
    s = _state(raw)
    return await s.completions.create(req, raw, s.adapters.resolve(req.model))


@v1.post("/chat/completions", responses=STREAMED)
async def create_chat_completion(req: ChatCompletionRequest, raw: Request) -> Any:
    s = _state(raw)
    return await s.chat.create(req, raw, s.adapters.resolve(req.model))


@v1.post("/responses", responses=STREAMED)
async def create_response(req: ResponsesRequest, raw: Request) -> Any:
    s = _state(raw)
    return await OpenAIServingResponses(s.chat).create(req, raw, s.adapters.resolve(req.model))


@v1.post("/embeddings")
async def create_embedding(req: EmbeddingRequest, raw: Request) -> Any:
    s = _state(raw)
    if s.adapters.resolve(req.model) is not None:
        raise ValueError(f"model: embeddings are computed by the base model "
                         f"({s.served_model_name}), not by a LoRA adapter")
    return await s.embeddings.create(req, raw)


def _token_ids(engine: LLMEngine, req: TokenizeRequest) -> list[int]:
    if req.messages is not None:
        how = Rendering(req.add_generation_prompt, add_special_tokens=False)
        return render_chat(engine, req.messages, how)["prompt_token_ids"]
    if req.prompt is not None:
        engine.check_text_length(len(req.prompt))
        return engine.tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens)
    raise ValueError("tokenize needs prompt or messages")


@keyed.post("/tokenize")
async def tokenize(req: TokenizeRequest, raw: Request) -> Any:
    s = _state(raw)
    s.adapters.resolve(req.model)  # an adapter's tokenizer is the model's
    ids = await asyncio.get_running_loop().run_in_executor(None, _token_ids, s.engine, req)
    return {"count": len(ids), "max_model_len": s.engine.config.model.max_model_len,
            "tokens": ids}


@keyed.post("/detokenize")
async def detokenize(req: DetokenizeRequest, raw: Request) -> Any:
    s = _state(raw)
    s.adapters.resolve(req.model)
    vocab = s.engine.config.model.vocab_size
    if any(not 0 <= t < vocab for t in req.tokens):
        raise ValueError(f"tokens must be ids in [0, {vocab})")
    text = await asyncio.get_running_loop().run_in_executor(
        None, s.engine.tokenizer.decode, req.tokens)
    return {"prompt": text}


ROUTERS = (public, v1, keyed)


# ---- errors ---------------------------------------------------------------------------------

def _respond(make: Callable[[Any], Response]) -> Callable[[Request, Any], Awaitable[Response]]:
    """An exception handler (Starlette awaits async ones) answering `make(exc)`."""
    async def handler(_: Request, exc: Any) -> Response:
        return make(exc)
    return handler


def _unexpected(exc: Exception) -> Response:
    logger.exception("unexpected error", exc_info=exc)
    return error_response(500, f"internal error: {type(exc).__name__}")


EXCEPTION_HANDLERS: dict[type[Exception], Callable[[Request, Any], Awaitable[Response]]] = {
    exc_class: _respond(make) for exc_class, make in [
        (Unauthorized, lambda exc: error_response(401, "invalid or missing API key")),
        (UnknownModel, lambda exc: error_response(404, str(exc), param="model")),
        (StarletteHTTPException, lambda exc: error_response(exc.status_code, str(exc.detail),
                                                            headers=exc.headers)),
        (ValueError, lambda exc: error_response(400, str(exc))),  # includes UnicodeError
        (Overloaded, lambda exc: error_response(
            429, str(exc), headers={"retry-after": str(RETRY_AFTER_S)})),
        (RequestFailed, lambda exc: error_response(500, str(exc))),
        (EngineDeadError, lambda exc: error_response(503, str(exc))),
        (EngineSleepingError, lambda exc: error_response(503, str(exc))),
        # nobody is listening; the requests were aborted
        (ClientDisconnected, lambda exc: Response(status_code=499)),
        (Exception, _unexpected),
    ]}


async def _invalid_request(request: Request, exc: RequestValidationError) -> Response:
    """400 for a body that fails validation, in the shape of the API its route belongs to."""
    message, param = _describe(exc.errors())
    if request.url.path.startswith(ANTHROPIC_PREFIX):
        return anthropic_error(400, "invalid_request_error", message)
    return error_response(400, message, param)


EXCEPTION_HANDLERS[RequestValidationError] = _invalid_request


def _describe(errors: list[Any]) -> tuple[str, str | None]:
    """(message, param) of a request validation error, naming the top-level field. Our own
    checks (value errors) explain best, so they go first; pydantic's union-member tags
    ("str", "function-after[...]") are left out of the field path."""
    errors = sorted(errors, key=lambda e: e.get("type") != "value_error")
    first = errors[0] if errors else {}
    if first.get("type") == "json_invalid":
        return f"malformed JSON body: {first.get('ctx', {}).get('error', '')}", None
    loc = [str(x) for x in first.get("loc", ())[1:]
           if isinstance(x, int) or (str(x).isidentifier() and str(x) not in _TYPE_TAGS)]
    msg = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
    if first.get("type") == "extra_forbidden":
        msg = "unknown field (tokenmill does not support it)"
    if first.get("type") == "missing" and not loc:
        return "a JSON object body is required", None
    param = loc[0] if loc else None
    return (f"{'.'.join(loc)}: {msg}" if loc else msg), param


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none", "TextPart"}
