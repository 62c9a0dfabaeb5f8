"""AsyncLLM: an LLMEngine stepping on its own thread, fed and drained from asyncio.

The event loop never waits for a model step and a step never waits for HTTP:

    event loop                         engine thread
    ----------                         -------------
    prepare_request (thread pool)
    commands.put(add) ───────────────► drain commands (add / abort)
                                       step()  → outputs
    per-request asyncio.Queue ◄─────── loop.call_soon_threadsafe(queue.put_nowait, out)

A request whose consumer goes away (client disconnect, cancellation) is aborted, which frees
its KV blocks on the engine thread's next iteration. An exception inside a step fails every
request in flight (each stream raises it) and the engine keeps serving new ones.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncIterator
from typing import Any

from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.metrics.stats import RequestTimings, SchedulerStats, StepTimings
from tokenmill.outputs import RequestOutput
from tokenmill.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    pass


class RequestStream:
    """The outputs of one request. Cancelled while waiting, closed, or garbage-collected before
    its last output, it aborts the request (so its KV blocks are freed), even if it was never
    iterated: an async generator that never started would run no `finally` at all."""

    def __init__(self, owner: AsyncLLM, request_id: str) -> None:
        self.owner, self.request_id = owner, request_id
        self.queue: asyncio.Queue = asyncio.Queue()
        self._done = False

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self._done:
            raise StopAsyncIteration
        try:
            out = await self.queue.get()
        except BaseException:  # cancelled: the consumer went away
            self.close()
            raise
        if isinstance(out, BaseException):
            self.close()
            raise out
        if out.finished:
            self._done = True
            self.owner._streams.pop(self.request_id, None)
        return out

    def close(self) -> None:
        if not self._done:
            self._done = True
            self.owner.abort(self.request_id)

    async def aclose(self) -> None:
        self.close()

    def __del__(self) -> None:
        self.close()


class AsyncLLM:
    def __init__(self, engine: LLMEngine, on_step: Any = None) -> None:
        """`on_step(SchedulerStats, StepTimings)` is called on the engine thread after each step."""
        self.engine = engine
        self.on_step = on_step
        self._commands: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._timings = RequestTimings()
        self._wakeup = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tokenmill-engine", daemon=True)

    # ---- lifecycle --------------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def shutdown(self) -> None:
        """Abort everything in flight (streams end with finish_reason "abort"), stop the thread."""
        self._stop.set()
        self._wakeup.set()
        self._thread.join(timeout=30)

    @property
    def is_running(self) -> bool:
        return self._thread.is_alive() and not self._stop.is_set()

    # ---- requests ---------------------------------------------------------------------------
    async def add_request(self, request_id: str, prompt: Any, params: SamplingParams
                          ) -> RequestStream:
        """Validate and queue a request (ValueError for a bad one); return its output stream.

        Iterating the stream to the end, closing it, cancelling its consumer or dropping it
        unfinished ends the request.
        """
        if not self.is_running:
            raise EngineDeadError("the engine is shutting down")
        loop = asyncio.get_running_loop()
        prepared = await loop.run_in_executor(None, self.engine.prepare_request, request_id,
                                              prompt, params)
        stream = RequestStream(self, request_id)
        self._streams[request_id] = (loop, stream.queue)
        self._send("add", prepared)
        return stream

    async def generate(self, request_id: str, prompt: Any, params: SamplingParams
                       ) -> AsyncIterator[RequestOutput]:
        """add_request + iterate: the whole stream of one request."""
        async for out in await self.add_request(request_id, prompt, params):
            yield out

    def abort(self, request_id: str) -> None:
        self._streams.pop(request_id, None)
        self._send("abort", request_id)

    def _send(self, kind: str, payload: Any) -> None:
        self._commands.put((kind, payload))
        self._wakeup.set()

    # ---- the engine thread ------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop.is_set():
            self._drain_commands()
            if not self.engine.has_unfinished_requests():
                self._wakeup.wait(timeout=0.5)
                self._wakeup.clear()
                continue
            try:
                outputs = self.engine.step()
            except Exception as e:  # a broken step must not take the server down
                logger.exception("engine step failed; failing the requests in flight")
                self._fail_all(e)
                continue
            for out in outputs:
                self._deliver(out.request_id, out)
            self._report(outputs)
        self._fail_all(EngineDeadError("the server is shutting down"))

    def _drain_commands(self) -> None:
        while True:
            try:
                kind, payload = self._commands.get_nowait()
            except queue.Empty:
                return
            if kind == "add":
                try:
                    self.engine.add_prepared(payload)
                except ValueError as e:
                    self._deliver(payload.request_id, e)
            else:
                self.engine.abort_request(payload)
                self._timings.forget(payload)

    def _deliver(self, request_id: str, item: RequestOutput | BaseException) -> None:
        stream = self._streams.get(request_id)
        if stream is not None:
            loop, q = stream
            loop.call_soon_threadsafe(q.put_nowait, item)

    def _report(self, outputs: list[RequestOutput]) -> None:
        if self.on_step is None:
            return
        step: StepTimings = self._timings.observe(outputs)
        stats: SchedulerStats = self.engine.stats()
        self.on_step(stats, step)

    def _fail_all(self, error: BaseException) -> None:
        for request_id in list(self.engine.outputs.parents):
            self.engine.abort_request(request_id)
            self._timings.forget(request_id)
            self._deliver(request_id, error)
