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
import dataclasses
import logging
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from tokenmill import __version__
from tokenmill.engine.async_engine import AsyncLLM
from tokenmill.engine.data_parallel import DataParallelLLM
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.lora.request import LoRARequest
from tokenmill.metrics.prometheus import PrometheusMetrics
from tokenmill.metrics.stat_logger import DEFAULT_INTERVAL_S, LoggingStatLogger
from tokenmill.metrics.stats import SchedulerStats, StepTimings
from tokenmill.server import lora_routes, messages_routes, sleep_routes
from tokenmill.server.admission import RETRY_AFTER_S, AdmissionControl
from tokenmill.server.http_options import HttpOptions
from tokenmill.server.lifecycle import ServerLifecycle
from tokenmill.server.lora_modules import ServedAdapters, runtime_updates_allowed
from tokenmill.server.middleware import EdgeMiddleware
from tokenmill.server.protocol import (
    ErrorResponse,
)
from tokenmill.server.request_log import RequestLog
from tokenmill.server.routes import EXCEPTION_HANDLERS, ROUTERS, ServerState
from tokenmill.server.serving_chat import OpenAIServingChat
from tokenmill.server.serving_common import ServingOptions
from tokenmill.server.serving_completion import OpenAIServingCompletion
from tokenmill.server.serving_embedding import OpenAIServingEmbedding
from tokenmill.server.tools import ToolOptions

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServerLimits:
    """What one server admits (`tokenmill serve` flags of the same names)."""

    max_waiting_requests: int = 256  # sequences that may wait beyond max_num_seqs
    max_request_body_bytes: int = 8 * 2**20
    request_timeout: float | None = None  # seconds; a request's own `timeout` may be shorter
    drain_timeout: float = 30.0  # seconds in-flight requests get on SIGTERM


@dataclass(frozen=True)
class ServerLogging:
    """What one server logs (`tokenmill serve` flags, vLLM's names)."""

    log_stats: bool = True  # the periodic engine line (--disable-log-stats)
    stats_interval_s: float = DEFAULT_INTERVAL_S
    log_requests: bool = False  # each request's prompt and params (--enable-log-requests)
    max_log_len: int | None = None  # --max-log-len: prompt characters or ids logged
    access_log: bool = True  # a line per HTTP request (--disable-uvicorn-access-log)
    uvicorn_log_level: str = "info"

    def __post_init__(self) -> None:  # (checked before the model loads)
        if self.max_log_len is not None and self.max_log_len < 0:
            raise ValueError(f"max_log_len must be >= 0, got {self.max_log_len}")
        if self.stats_interval_s <= 0:
            raise ValueError(f"stats_interval_s must be > 0, got {self.stats_interval_s}")


_ERROR_STATUSES = {400: "Invalid request", 401: "Invalid API key", 404: "Unknown model",
                   413: "Body too large",
                   429: "Overloaded", 500: "The engine failed the request",
                   503: "Shutting down or engine dead"}


def build_app(engine: LLMEngine | list[LLMEngine], served_model_name: str | Sequence[str],
              api_key: str | None = None, limits: ServerLimits | None = None,
              tool_options: ToolOptions | None = None,
              data_parallel_router: str = "cache_aware",
              lora_modules: Sequence[LoRARequest] = (),
              log: ServerLogging | None = None, http: HttpOptions | None = None,
              answers: ServingOptions | None = None) -> FastAPI:
    """The app over one engine, or over data-parallel replicas (a list of engines, one
    request routed to one of them: engine/data_parallel.py); its routes: routes.py (and
    lora_routes.py where runtime LoRA updates are allowed). `lora_modules`: the adapters served
    by name (ValueError for one that cannot be served)."""
    limits, log, http = limits or ServerLimits(), log or ServerLogging(), http or HttpOptions()
    engines = engine if isinstance(engine, list) else [engine]
    engine = engines[0]  # the replicas share tokenizer and config
    # vLLM's: a request may name any of the names; answers (and metrics) name the first
    adapters = ServedAdapters(served_model_name, engine.adapters.resolve,
                              enabled=engine.config.lora is not None)
    served_model_name = adapters.base_name
    metrics = _metrics(engines, served_model_name)
    admission = AdmissionControl(engine.config.scheduler.max_num_seqs * len(engines),
                                 limits.max_waiting_requests)

    stat_logger = LoggingStatLogger(log.stats_interval_s) if log.log_stats else None

    def on_dead(_: BaseException) -> None:
        lifecycle.call_soon(lifecycle.engine_died)

    def on_step(stats: SchedulerStats, step: StepTimings, replica: int = 0) -> None:
        metrics.record(stats, step, replica)
        if stat_logger is not None:
            stat_logger.record(stats, step, replica)

    async_llm: AsyncLLM | DataParallelLLM = (
        AsyncLLM(engine, on_step=on_step, on_dead=on_dead) if len(engines) == 1
        else DataParallelLLM(engines, data_parallel_router, on_step=on_step,
                             on_dead=on_dead))
    lifecycle = ServerLifecycle(async_llm, admission, limits.drain_timeout)
    answers = dataclasses.replace(
        answers or ServingOptions(),
        request_log=RequestLog(log.max_log_len) if log.log_requests else None)
    serving = (async_llm, served_model_name, admission, limits.request_timeout, answers)

    app = FastAPI(title="tokenmill", version=__version__,
                  lifespan=_lifespan(lifecycle, async_llm, stat_logger),
                  responses={code: {"model": ErrorResponse, "description": text}
                             for code, text in _ERROR_STATUSES.items()}, **http.app_kwargs())
    for lora in lora_modules:
        adapters.add(lora)
    app.state.server = ServerState(
        engine, async_llm, lifecycle, metrics, served_model_name, api_key,
        OpenAIServingCompletion(*serving), OpenAIServingChat(*serving, tool_options=tool_options),
        OpenAIServingEmbedding(*serving), adapters)
    app.add_middleware(EdgeMiddleware, max_body_bytes=limits.max_request_body_bytes,
                       is_draining=lambda: lifecycle.draining, overloaded=admission.full,
                       retry_after_s=RETRY_AFTER_S, access_log=log.access_log)
    http.add_cors(app)  # (last: the outermost, answering preflights first)
    _add_routes(app, engine)
    return app


def _metrics(engines: list[LLMEngine], served_model_name: str) -> PrometheusMetrics:
    config = engines[0].config
    return PrometheusMetrics(
        served_model_name,
        kv_capacity_tokens=sum(e.kv.num_usable_blocks * e.kv.block_size for e in engines),
        kv_cache_dtype=config.cache.kv_cache_dtype,
        max_loras=None if config.lora is None else config.lora.max_loras)


def _lifespan(lifecycle: ServerLifecycle, async_llm: AsyncLLM | DataParallelLLM,
              stat_logger: LoggingStatLogger | None) -> Any:
    """The app's lifespan: the engine thread(s) and the periodic stats line run while it
    does."""
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        lifecycle.loop = asyncio.get_running_loop()
        logger.info("%s", lifecycle.http_stack())
        async_llm.start()
        stats_task = (None if stat_logger is None
                      else asyncio.get_running_loop().create_task(_log_stats(stat_logger)))
        yield
        if stats_task is not None:
            stats_task.cancel()
        async_llm.shutdown()

    return lifespan


def _add_routes(app: FastAPI, engine: LLMEngine) -> None:
    """Exception handlers and routers (LoRA updates and sleep where enabled)."""
    for exc_class, handler in EXCEPTION_HANDLERS.items():
        app.add_exception_handler(exc_class, handler)
    optional = ([lora_routes.router] if runtime_updates_allowed() else []) + (
        [sleep_routes.router] if engine.config.enable_sleep_mode else [])
    for router in (*ROUTERS, messages_routes.router, *optional):
        app.include_router(router)
    _document_400_not_422(app)


async def _log_stats(stat_logger: LoggingStatLogger) -> None:
    """The periodic engine line, from the event loop (the engine threads only record)."""
    while True:
        await asyncio.sleep(stat_logger.interval_s)
        stat_logger.log()


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
               api_key: str | None, served_model_name: str | Sequence[str] | None,
               limits: ServerLimits | None = None, tool_options: ToolOptions | None = None,
               data_parallel_router: str = "cache_aware",
               lora_modules: Sequence[LoRARequest] = (), log: ServerLogging | None = None,
               http: HttpOptions | None = None, answers: ServingOptions | None = None) -> int:
    """Serve until SIGINT/SIGTERM (drained: exit 0) or the engine's death (exit 1)."""
    import uvicorn

    from tokenmill.server.lifecycle import DrainingServer

    first = engine[0] if isinstance(engine, list) else engine
    name = served_model_name or default_served_name(first)
    log, http = log or ServerLogging(), http or HttpOptions()
    app = build_app(engine, name, api_key, limits, tool_options, data_parallel_router,
                    lora_modules, log, http, answers)
    # uvicorn's access log is off: ours (middleware.py) carries the request id.
    config = uvicorn.Config(app, host=host, port=port, log_level=log.uvicorn_log_level,
                            access_log=False, log_config=None, timeout_graceful_shutdown=5,
                            **http.uvicorn_kwargs())
    server = DrainingServer(config, app.state.server.lifecycle)
    logger.info("serving %s on %s://%s:%d", name, "https" if http.ssl_keyfile else "http",
                host, port)
    server.run()
    return app.state.server.lifecycle.exit_code
