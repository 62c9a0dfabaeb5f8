"""How a server ends: a graceful drain on SIGINT/SIGTERM, and a non-zero exit when the engine
dies.

Drain, in order:
1. stop accepting: every route but /health and /metrics answers 503 in the OpenAI shape, and
   /health itself answers 503, so a load balancer takes the server out of rotation; the
   listening socket stays open, so clients get that 503 rather than "connection refused";
2. let the requests in flight finish, up to `drain_timeout` seconds;
3. end what is left: every remaining request is aborted and each stream sends its final chunk
   (finish_reason "abort") and [DONE]; a non-streaming request returns what it has;
4. once no response is left open (or after a short grace), tell uvicorn to exit: no task is
   cancelled mid-response, so nothing prints a traceback. The exit status is 0.

An engine that dies makes the server exit with status 1 (after a second in which /health
reports it and the failed requests get their errors), so a supervisor restarts it.
A second signal during a drain exits at once.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from collections.abc import Callable
from types import FrameType

import uvicorn

from tokenmill.engine.async_engine import AsyncLLM
from tokenmill.server.admission import AdmissionControl

logger = logging.getLogger(__name__)
_ABORT_GRACE_S = 5.0
_DEAD_REPORT_S = 1.0  # a dead server answers /health with 503 this long before exiting
_POLL_S = 0.05


class ServerLifecycle:
    def __init__(self, async_llm: AsyncLLM, admission: AdmissionControl,
                 drain_timeout: float) -> None:
        self.async_llm, self.admission, self.drain_timeout = async_llm, admission, drain_timeout
        self.draining = False
        self.exit_code = 0
        self.server: uvicorn.Server | None = None  # set by the server that runs the app
        self.loop: asyncio.AbstractEventLoop | None = None  # the app's, set by its lifespan
        self._drain_task: asyncio.Task | None = None

    def http_stack(self) -> str:
        """The event loop's and the HTTP protocol's implementations serving the app, for the
        start-up log: uvloop and httptools, which uvicorn takes when they are installed (they
        are dependencies), else asyncio's loop and h11."""
        loop = type(self.loop).__module__.split(".")[0] if self.loop is not None else "none"
        config = self.server.config if self.server is not None else None
        http = (config.http_protocol_class.__name__ if config is not None and config.loaded
                else "not uvicorn's")
        return f"event loop {loop}, HTTP protocol {http}"

    def call_soon(self, callback: Callable[[], None]) -> None:
        """Run `callback` on the app's event loop, from any thread (signal handler, engine)."""
        if self.loop is not None:
            self.loop.call_soon_threadsafe(callback)

    def begin_drain(self) -> None:
        """Start the drain (on the event loop); later calls do nothing."""
        if self._drain_task is None:
            self._drain_task = asyncio.get_running_loop().create_task(self.drain())

    async def drain(self) -> None:
        self.draining = True
        n = self.admission.requests
        logger.info("draining: %d requests in flight, waiting up to %.0f s", n,
                    self.drain_timeout)
        if not await self._wait_idle(self.drain_timeout):
            logger.warning("drain timeout: aborting %d requests", self.admission.requests)
            self.async_llm.abort_all()
            await self._wait_idle(_ABORT_GRACE_S)
        logger.info("drained; shutting down")
        self._exit()

    def engine_died(self) -> None:
        """Called on the event loop once the engine is dead: exit 1 once the failed requests
        have had their errors sent (at most a few seconds; /health says "dead" meanwhile)."""
        self.draining = True
        self.exit_code = 1
        if self._drain_task is None:
            self._drain_task = asyncio.get_running_loop().create_task(self._exit_dead())

    async def _exit_dead(self) -> None:
        await asyncio.sleep(_DEAD_REPORT_S)
        await self._wait_idle(_ABORT_GRACE_S)
        self._exit()

    async def _wait_idle(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while self.admission.requests > 0:
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(_POLL_S)
        return True

    def _exit(self) -> None:
        if self.server is not None:
            self.server.should_exit = True


class DrainingServer(uvicorn.Server):
    """uvicorn's server with our drain in place of its own signal handling (which closes the
    socket at once and cancels responses still running after its grace period)."""

    def __init__(self, config: uvicorn.Config, lifecycle: ServerLifecycle) -> None:
        super().__init__(config)
        self.lifecycle = lifecycle
        lifecycle.server = self

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.lifecycle.draining or self.lifecycle.loop is None:
            self.force_exit = self.should_exit = True  # a second signal, or before start-up
            return
        logger.info("received %s", signal.Signals(sig).name)
        self.lifecycle.call_soon(self.lifecycle.begin_drain)
