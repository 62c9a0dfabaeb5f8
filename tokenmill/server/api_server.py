"""The FastAPI app: OpenAI-compatible routes plus /health, /metrics, /tokenize, /detokenize and
/version, and `run_server` behind `tokenmill serve`.

Every error the server returns has OpenAI's shape {"error": {"message", "type", "param",
"code"}}: 400 for malformed JSON, invalid or unsupported fields and over-long prompts; 401 for a
missing or wrong API key (when one is set: every route but /health, /metrics and /version);
404 for an unknown model or route; 405 for a wrong method; 413 for a body over the limit; 429
(with Retry-After) when admission control is full; 500 for a request the engine failed alone;
503 while draining or once the engine is dead. See middleware.py (request ids, body limit),
admission.py (the 429) and lifecycle.py (the drain on SIGINT/SIGTERM, exit 1 on engine death).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from tokenmill import __version__
from tokenmill.engine.async_engine import AsyncLLM, EngineDeadError
from tokenmill.engine.data_parallel import DataParallelLLM
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.metrics.prometheus import PrometheusMetrics
from tokenmill.server.admission import RETRY_AFTER_S, AdmissionControl, Overloaded
from tokenmill.server.lifecycle import ServerLifecycle
from tokenmill.server.middleware import EdgeMiddleware
from tokenmill.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    ErrorResponse,
    ModelCard,
    TokenizeRequest,
)
from tokenmill.server.serving_chat import OpenAIServingChat, render_chat
from tokenmill.server.serving_common import ClientDisconnected, RequestFailed, error_response
from tokenmill.server.serving_completion import OpenAIServingCompletion
from tokenmill.server.serving_embedding import EmbeddingRequest, OpenAIServingEmbedding
from tokenmill.server.tools import ToolOptions

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServerLimits:
    """What one server admits (`tokenmill serve` flags of the same names)."""

    max_waiting_requests: int = 256  # sequences that may wait beyond max_num_seqs
    max_request_body_bytes: int = 8 * 2**20
    request_timeout: float | None = None  # seconds; a request's own `timeout` may be shorter
    drain_timeout: float = 30.0  # seconds in-flight requests get on SIGTERM


class Unauthorized(Exception):
    pass


_ERROR_STATUSES = {400: "Invalid request", 401: "Invalid API key", 404: "Unknown model",
                   413: "Body too large",
                   429: "Overloaded", 500: "The engine failed the request",
                   503: "Shutting down or engine dead"}


def build_app(engine: LLMEngine | list[LLMEngine], served_model_name: str,
              api_key: str | None = None, limits: ServerLimits | None = None,
              tool_options: ToolOptions | None = None,
              data_parallel_router: str = "cache_aware") -> FastAPI:
    """The app over one engine, or over data-parallel replicas (a list of engines, one
    request routed to one of them: engine/data_parallel.py)."""
    limits = limits or ServerLimits()
    engines = engine if isinstance(engine, list) else [engine]
    engine = engines[0]  # the replicas share tokenizer and config
    metrics = PrometheusMetrics(served_model_name, kv_capacity_tokens=sum(
        e.kv.num_usable_blocks * e.kv.block_size for e in engines),
        kv_cache_dtype=engine.config.cache.kv_cache_dtype)
    admission = AdmissionControl(engine.config.scheduler.max_num_seqs * len(engines),
                                 limits.max_waiting_requests)

    def on_dead(_: BaseException) -> None:
        lifecycle.call_soon(lifecycle.engine_died)

    async_llm: AsyncLLM | DataParallelLLM = (
        AsyncLLM(engine, on_step=metrics.record, on_dead=on_dead) if len(engines) == 1
        else DataParallelLLM(engines, data_parallel_router, on_step=metrics.record,
                             on_dead=on_dead))
    lifecycle = ServerLifecycle(async_llm, admission, limits.drain_timeout)
    serving = (async_llm, served_model_name, admission, limits.request_timeout)
    completions = OpenAIServingCompletion(*serving)
    chat = OpenAIServingChat(*serving, tool_options=tool_options)
    embeddings = OpenAIServingEmbedding(*serving)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        lifecycle.loop = asyncio.get_running_loop()
        async_llm.start()
        yield
        async_llm.shutdown()

    app = FastAPI(title="tokenmill", version=__version__, lifespan=lifespan,
                  responses={code: {"model": ErrorResponse, "description": text}
                             for code, text in _ERROR_STATUSES.items()})
    app.state.async_llm, app.state.lifecycle, app.state.admission = async_llm, lifecycle, admission
    app.add_middleware(EdgeMiddleware, max_body_bytes=limits.max_request_body_bytes,
                       is_draining=lambda: lifecycle.draining, overloaded=admission.full,
                       retry_after_s=RETRY_AFTER_S)

    async def check_api_key(request: Request) -> None:
        # NOTE: a dependency, not BaseHTTPMiddleware, which hides client disconnects from
        # streaming responses.
        if api_key and request.headers.get("authorization") != f"Bearer {api_key}":
            raise Unauthorized

    v1 = APIRouter(prefix="/v1", dependencies=[Depends(check_api_key)])
    keyed = APIRouter(dependencies=[Depends(check_api_key)])

    @app.exception_handler(Unauthorized)
    async def on_unauthorized(_: Request, exc: Unauthorized) -> JSONResponse:
        return error_response(401, "invalid or missing API key")

    @app.exception_handler(RequestValidationError)
    async def on_invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(400, *_describe(exc.errors()))

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(exc.status_code, str(exc.detail), headers=exc.headers)

    @app.exception_handler(ValueError)
    async def on_value_error(_: Request, exc: ValueError) -> JSONResponse:
        return error_response(400, str(exc))  # includes UnicodeError

    @app.exception_handler(Overloaded)
    async def on_overloaded(_: Request, exc: Overloaded) -> JSONResponse:
        return error_response(429, str(exc), headers={"retry-after": str(RETRY_AFTER_S)})

    @app.exception_handler(RequestFailed)
    async def on_failed(_: Request, exc: RequestFailed) -> JSONResponse:
        return error_response(500, str(exc))

    @app.exception_handler(EngineDeadError)
    async def on_dead_error(_: Request, exc: EngineDeadError) -> JSONResponse:
        return error_response(503, str(exc))

    @app.exception_handler(ClientDisconnected)
    async def on_disconnect(_: Request, exc: ClientDisconnected) -> Response:
        return Response(status_code=499)  # nobody is listening; the requests were aborted

    @app.exception_handler(Exception)
    async def on_unexpected(_: Request, exc: Exception) -> JSONResponse:
        logger.exception("unexpected error")
        return error_response(500, f"internal error: {type(exc).__name__}")

    def unknown_model(name: str | None) -> JSONResponse | None:
        if name is None or name == served_model_name:
            return None
        return error_response(404, f"The model `{name}` does not exist.", param="model")

    @app.get("/health", response_class=Response,
             responses={200: {"description": "Healthy (empty body)", "content": {}}})
    async def health() -> Response:
        if async_llm.dead_error is not None:
            return error_response(503, f"the engine is dead: {async_llm.dead_error}")
        if lifecycle.draining or not async_llm.is_running:
            return error_response(503, "the server is shutting down")
        return Response(status_code=200)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": __version__}

    @v1.get("/models")
    async def models() -> dict[str, Any]:
        card = ModelCard(id=served_model_name, max_model_len=engine.config.model.max_model_len)
        return {"object": "list", "data": [card.model_dump()]}

    @v1.post("/completions")
    async def create_completion(req: CompletionRequest, raw: Request) -> Any:
        return unknown_model(req.model) or await completions.create(req, raw)

    @v1.post("/chat/completions")
    async def create_chat_completion(req: ChatCompletionRequest, raw: Request) -> Any:
        return unknown_model(req.model) or await chat.create(req, raw)

    @v1.post("/embeddings")
    async def create_embedding(req: EmbeddingRequest, raw: Request) -> Any:
        return unknown_model(req.model) or await embeddings.create(req, raw)

    def tokenize_sync(req: TokenizeRequest) -> list[int]:
        if req.messages is not None:
            return render_chat(engine, req.messages, req.add_generation_prompt)[
                "prompt_token_ids"]
        if req.prompt is not None:
            engine.check_text_length(len(req.prompt))
            return engine.tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens)
        raise ValueError("tokenize needs prompt or messages")

    @keyed.post("/tokenize")
    async def tokenize(req: TokenizeRequest) -> Any:
        if (err := unknown_model(req.model)) is not None:
            return err
        ids = await asyncio.get_running_loop().run_in_executor(None, tokenize_sync, req)
        return {"count": len(ids), "max_model_len": engine.config.model.max_model_len,
                "tokens": ids}

    @keyed.post("/detokenize")
    async def detokenize(req: DetokenizeRequest) -> Any:
        if (err := unknown_model(req.model)) is not None:
            return err
        vocab = engine.config.model.vocab_size
        if any(not 0 <= t < vocab for t in req.tokens):
            raise ValueError(f"tokens must be ids in [0, {vocab})")
        text = await asyncio.get_running_loop().run_in_executor(
            None, engine.tokenizer.decode, req.tokens)
        return {"prompt": text}

    @app.get("/metrics", response_class=Response, responses={200: {
        "description": "Prometheus text format", "content": {"text/plain": {}}}})
    async def prometheus_metrics() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    app.include_router(v1)
    app.include_router(keyed)
    _document_400_not_422(app)
    return app


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


def _document_400_not_422(app: FastAPI) -> None:
    """The OpenAPI schema says what the server does: validation errors are 400 (OpenAI's
    choice), never FastAPI's default 422."""
    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            for path in schema.get("paths", {}).values():
                for op in path.values():
                    op.get("responses", {}).pop("422", None)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def default_served_name(engine: LLMEngine) -> str:
    return engine.config.model.served_name


def run_server(engine: LLMEngine | list[LLMEngine], host: str, port: int,
               api_key: str | None, served_model_name: str | None,
               limits: ServerLimits | None = None, tool_options: ToolOptions | None = None,
               data_parallel_router: str = "cache_aware") -> int:
    """Serve until SIGINT/SIGTERM (drained: exit 0) or the engine's death (exit 1)."""
    import uvicorn

    from tokenmill.server.lifecycle import DrainingServer

    first = engine[0] if isinstance(engine, list) else engine
    name = served_model_name or default_served_name(first)
    app = build_app(engine, name, api_key, limits, tool_options, data_parallel_router)
    # uvicorn's access log is off: ours (middleware.py) carries the request id.
    config = uvicorn.Config(app, host=host, port=port, log_level="info", access_log=False,
                            log_config=None, timeout_graceful_shutdown=5)
    server = DrainingServer(config, app.state.lifecycle)
    logger.info("serving %s on http://%s:%d", name, host, port)
    server.run()
    return app.state.lifecycle.exit_code
