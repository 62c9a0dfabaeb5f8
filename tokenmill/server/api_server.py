"""The FastAPI app: OpenAI-compatible routes plus /health, /metrics, /tokenize, /detokenize and
/version, and `run_server` behind `tokenmill serve`.

Errors use OpenAI's shape {"error": {"message", "type", "param", "code"}}: 400 for malformed JSON,
invalid parameters and over-long prompts; 401 for a missing or wrong API key (when one is set);
404 for an unknown model name; 503 while shutting down. The engine thread starts and stops with
the app's lifespan; on SIGINT/SIGTERM uvicorn stops accepting, lets in-flight requests finish
(up to a grace period, after which they are aborted) and the process exits 0.
"""

from __future__ import annotations

import contextlib
import logging
import signal
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from tokenmill import __version__
from tokenmill.engine.async_engine import AsyncLLM, EngineDeadError
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.metrics.prometheus import PrometheusMetrics
from tokenmill.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    ModelCard,
    TokenizeRequest,
)
from tokenmill.server.serving_chat import OpenAIServingChat, render_chat
from tokenmill.server.serving_common import ClientDisconnected, error_response
from tokenmill.server.serving_completion import OpenAIServingCompletion

logger = logging.getLogger(__name__)
GRACEFUL_SHUTDOWN_S = 10


class Unauthorized(Exception):
    pass


def build_app(engine: LLMEngine, served_model_name: str, api_key: str | None = None) -> FastAPI:
    metrics = PrometheusMetrics(served_model_name)
    async_llm = AsyncLLM(engine, on_step=metrics.record)
    completions = OpenAIServingCompletion(async_llm, served_model_name)
    chat = OpenAIServingChat(async_llm, served_model_name)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async_llm.start()
        yield
        async_llm.shutdown()

    app = FastAPI(title="tokenmill", version=__version__, lifespan=lifespan)
    app.state.async_llm = async_llm

    async def check_api_key(request: Request) -> None:
        # NOTE: a dependency, not BaseHTTPMiddleware, which hides client disconnects from
        # streaming responses.
        if api_key and request.headers.get("authorization") != f"Bearer {api_key}":
            raise Unauthorized

    v1 = APIRouter(prefix="/v1", dependencies=[Depends(check_api_key)])

    @app.exception_handler(Unauthorized)
    async def on_unauthorized(_: Request, exc: Unauthorized) -> JSONResponse:
        return error_response(401, "invalid or missing API key")

    @app.exception_handler(RequestValidationError)
    async def on_invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        if first.get("type") == "json_invalid":
            return error_response(400, f"malformed JSON body: {first.get('msg', '')}")
        loc = ".".join(str(x) for x in first.get("loc", ())[1:])
        return error_response(400, f"{loc}: {first.get('msg', 'invalid value')}",
                              param=loc or None)

    @app.exception_handler(ValueError)
    async def on_value_error(_: Request, exc: ValueError) -> JSONResponse:
        return error_response(400, str(exc))

    @app.exception_handler(EngineDeadError)
    async def on_dead(_: Request, exc: EngineDeadError) -> JSONResponse:
        return error_response(503, str(exc))

    @app.exception_handler(ClientDisconnected)
    async def on_disconnect(_: Request, exc: ClientDisconnected) -> Response:
        return Response(status_code=499)  # nobody is listening; the requests were aborted

    def unknown_model(name: str | None) -> JSONResponse | None:
        if name is None or name == served_model_name:
            return None
        return error_response(404, f"The model `{name}` does not exist.", param="model")

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200 if async_llm.is_running else 503)

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

    @app.post("/tokenize")
    async def tokenize(req: TokenizeRequest) -> Any:
        if (err := unknown_model(req.model)) is not None:
            return err
        if req.messages is not None:
            ids = render_chat(engine.tokenizer, req.messages,
                              req.add_generation_prompt)["prompt_token_ids"]
        elif req.prompt is not None:
            ids = engine.tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens)
        else:
            raise ValueError("tokenize needs prompt or messages")
        return {"count": len(ids), "max_model_len": engine.config.model.max_model_len,
                "tokens": ids}

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest) -> Any:
        if (err := unknown_model(req.model)) is not None:
            return err
        vocab = engine.config.model.vocab_size
        if any(not 0 <= t < vocab for t in req.tokens):
            raise ValueError(f"tokens must be ids in [0, {vocab})")
        return {"prompt": engine.tokenizer.decode(req.tokens)}

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    app.include_router(v1)
    return app


def default_served_name(engine: LLMEngine) -> str:
    import os

    path = engine.config.model.gguf_file or engine.config.model.path
    name = os.path.basename(os.path.normpath(path))
    return name[:-5] if name.endswith(".gguf") else name


def run_server(engine: LLMEngine, host: str, port: int, api_key: str | None,
               served_model_name: str | None) -> int:
    import uvicorn

    name = served_model_name or default_served_name(engine)
    app = build_app(engine, name, api_key)
    config = uvicorn.Config(app, host=host, port=port, log_level="info",
                            timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S)
    # NOTE: uvicorn re-raises the stop signal once it has shut down; a no-op handler makes a
    # graceful SIGINT/SIGTERM end in exit status 0 instead of a traceback or 143.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: None)
    logger.info("serving %s on http://%s:%d", name, host, port)
    uvicorn.Server(config).run()
    return 0
