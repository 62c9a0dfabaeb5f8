"""AsyncLLM: an LLMEngine stepping on its own thread, fed and drained from asyncio.

The event loop never waits for a model step and a step never waits for HTTP:

    event loop                         engine thread
    ----------                         -------------
    prepare_request (thread pool)
    commands.put(add) ───────────────► drain commands (add / abort)
                                       step()  → outputs
    per-request RequestStream ◄─────── loop.call_soon_threadsafe(put all of a step's outputs)
    (outputs not read yet coalesce: engine/request_stream.py)

A request whose consumer goes away (client disconnect, cancellation) is aborted, which frees
its KV blocks on the engine thread's next iteration. A request past its deadline, or still
running when `abort_all` is called (shutdown), ends with a final output whose finish_reason is
"abort". A request that fails inside a step ends with finish_reason "error" (LLMEngine isolates
it); an engine-wide failure marks the engine dead: every stream raises EngineDeadError, new
requests are refused, and `on_dead` is called so that the server can exit non-zero.

Metrics stay true: the scheduler's gauges are published after every step and after every
batch of commands (aborts, deadlines), so an idle or failed engine reports zero running.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import heapq
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator
from typing import Any

from tokenmill.engine.llm_engine import EngineDeadError, EngineSleepingError, LLMEngine
from tokenmill.engine.request_intake import PreparedRequest
from tokenmill.engine.request_stream import RequestStream
from tokenmill.lora.request import LoRARequest
from tokenmill.metrics.stats import RequestTimings, SchedulerStats, StepTimings
from tokenmill.outputs import RequestOutput
from tokenmill.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


__all__ = ["AsyncLLM", "EngineDeadError", "RequestStream"]


def _put_all(puts: list[tuple[RequestStream, Any]]) -> None:
    for stream, item in puts:
        stream.put(item)


class AsyncLLM:
    def __init__(self, engine: LLMEngine, on_step: Any = None, on_dead: Any = None) -> None:
        """`on_step(SchedulerStats, StepTimings)` is called on the engine thread after each step
        and after each batch of commands; `on_dead(error)` once if the engine dies."""
        self.engine = engine
        self.on_step = on_step
        self.on_dead = on_dead
        self.dead_error: BaseException | None = None
        self._commands: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, RequestStream]] = {}
        self._deadlines: list[tuple[float, str]] = []  # heap of (monotonic deadline, id)
        if on_step is not None:  # the engine's output processor times each request
            engine.outputs.timings = RequestTimings()
        self._wakeup = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tokenmill-engine", daemon=True)

    # ---- lifecycle --------------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def shutdown(self) -> None:
        """Stop the thread; anything still in flight raises EngineDeadError in its stream."""
        self._stop.set()
        self._wakeup.set()
        self._thread.join(timeout=30)
        self.engine.shutdown()

    @property
    def is_running(self) -> bool:
        return self._thread.is_alive() and not self._stop.is_set() and self.dead_error is None

    # ---- requests ---------------------------------------------------------------------------
    async def add_request(self, request_id: str, prompt: Any, params: SamplingParams,
                          deadline: float | None = None,
                          lora_request: LoRARequest | None = None, priority: int = 0
                          ) -> RequestStream:
        """Validate and queue a request (ValueError for a bad one), with the LoRA adapter
        `lora_request` names if any and its `priority`; return its output stream.

        Iterating the stream to the end, closing it, cancelling its consumer or dropping it
        unfinished ends the request. At `deadline` (time.monotonic()) it is aborted and its
        stream ends with finish_reason "abort".
        """
        return self.submit(await self.prepare(request_id, prompt, params, lora_request,
                                              priority), deadline)

    async def prepare(self, request_id: str, prompt: Any, params: SamplingParams,
                      lora_request: LoRARequest | None = None, priority: int = 0
                      ) -> PreparedRequest:
        """Tokenize and validate (ValueError for a bad request), off the event loop."""
        self._check_running()
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(None, functools.partial(
            self.engine.prepare_request, request_id, prompt, params,
            lora_request=lora_request, priority=priority))

    def submit(self, prepared: PreparedRequest, deadline: float | None = None
               ) -> RequestStream:
        """Queue a prepared request for the engine thread; its output stream."""
        self._check_running()
        if self.engine.is_sleeping:
            raise EngineSleepingError("the engine is asleep (sleep mode): POST /wake_up first")
        stream = RequestStream(self, prepared.request_id, prepared.params.output_kind)
        self._streams[prepared.request_id] = (asyncio.get_running_loop(), stream)
        self._send("add", (prepared, deadline))
        return stream

    @property
    def num_requests(self) -> int:
        """Requests whose stream has not ended (the load a data-parallel router sees)."""
        return len(self._streams)

    def has_request(self, request_id: str) -> bool:
        return request_id in self._streams

    def _check_running(self) -> None:
        if self.dead_error is not None:
            raise EngineDeadError(f"the engine is dead: {self.dead_error}")
        if not self.is_running:
            raise EngineDeadError("the engine is shutting down")

    async def generate(self, request_id: str, prompt: Any, params: SamplingParams
                       ) -> AsyncIterator[RequestOutput]:
        """add_request + iterate: the whole stream of one request."""
        async for out in await self.add_request(request_id, prompt, params):
            yield out

    def stream_ended(self, request_id: str) -> None:
        """A stream read its last output (RequestStream calls it)."""
        self._streams.pop(request_id, None)

    def abort(self, request_id: str) -> None:
        """Drop a request whose consumer is gone (nothing more is delivered)."""
        self._streams.pop(request_id, None)
        self._send("abort", request_id)

    def abort_all(self) -> None:
        """End every request in flight now: each stream gets a final output whose running
        samples have finish_reason "abort" (graceful shutdown past its drain timeout)."""
        self._send("abort_all", None)

    async def sleep(self, level: int = 1) -> None:
        """LLMEngine.sleep on the engine thread (ValueError: off, a bad level, or busy)."""
        await self._call(functools.partial(self.engine.sleep, level))

    async def wake_up(self) -> None:
        await self._call(self.engine.wake_up)

    @property
    def is_sleeping(self) -> bool:
        return self.engine.is_sleeping

    async def _call(self, fn: Any) -> Any:
        """fn() on the engine thread, between steps; its result or exception."""
        self._check_running()
        done: concurrent.futures.Future = concurrent.futures.Future()
        self._send("call", (fn, done))
        return await asyncio.wrap_future(done)

    def _send(self, kind: str, payload: Any) -> None:
        self._commands.put((kind, payload))
        self._wakeup.set()

    # ---- the engine thread ------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop.is_set():
            if self._drain_commands() | self._expire_deadlines():
                self._publish()
            if not self.engine.has_unfinished_requests():
                self._wakeup.wait(timeout=0.5)
                self._wakeup.clear()
                try:  # a worker that dies while the engine idles: unhealthy at once
                    self.engine.check_health()
                except Exception as e:
                    self._die(e)
                    return
                continue
            try:
                outputs = self.engine.step()
            except Exception as e:  # EngineDeadError, or a bug outside any one request
                self._die(e)
                return
            # metrics first: a client that has its last token and then reads /metrics finds
            # the step counted (delivered first, a loaded machine let it read them before)
            self._publish()
            self._deliver_all([(out.request_id, out) for out in outputs])
        self._fail_all(EngineDeadError("the server is shutting down"))

    def _drain_commands(self) -> bool:
        """Apply queued commands; whether there were any."""
        handled = False
        while True:
            try:
                kind, payload = self._commands.get_nowait()
            except queue.Empty:
                return handled
            handled = True
            if kind == "add":
                prepared, deadline = payload
                try:
                    self.engine.add_prepared(prepared)
                except (ValueError, EngineSleepingError) as e:
                    self._deliver(prepared.request_id, e)
                    continue
                if deadline is not None:
                    heapq.heappush(self._deadlines, (deadline, prepared.request_id))
            elif kind == "call":
                fn, done = payload
                try:
                    done.set_result(fn())
                except Exception as e:  # the caller's to handle
                    done.set_exception(e)
            elif kind == "abort":
                self.engine.abort_request(payload)
            else:  # abort_all
                for request_id in self.engine.outputs.request_ids():
                    self._finish_aborted(request_id)

    def _expire_deadlines(self) -> bool:
        now, expired = time.monotonic(), False
        while self._deadlines and self._deadlines[0][0] <= now:
            _, request_id = heapq.heappop(self._deadlines)
            expired |= self._finish_aborted(request_id, "its deadline passed")
        return expired

    def _finish_aborted(self, request_id: str, why: str = "the server is shutting down") -> bool:
        out = self.engine.finish_request(request_id, "abort")
        if out is None:
            return False
        logger.info("request %s aborted: %s", request_id, why)
        self._deliver(request_id, out)
        return True

    def _deliver(self, request_id: str, item: RequestOutput | BaseException) -> None:
        self._deliver_all([(request_id, item)])

    def _deliver_all(self, items: list[tuple[str, RequestOutput | BaseException]]) -> None:
        """Hand items to their streams: one wake-up of each event loop for all of them (a
        step's hundreds of outputs were as many wake-ups, which a loaded loop runs late)."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[RequestStream, Any]]] = {}
        for request_id, item in items:
            entry = self._streams.get(request_id)
            if entry is not None:
                loop, stream = entry
                by_loop.setdefault(loop, []).append((stream, item))
        for loop, puts in by_loop.items():
            loop.call_soon_threadsafe(_put_all, puts)

    def _publish(self) -> None:
        if self.on_step is None:
            return
        step: StepTimings = self.engine.outputs.timings.take()
        stats: SchedulerStats = self.engine.stats()
        self.on_step(stats, step)

    def _die(self, error: BaseException) -> None:
        logger.critical("the engine died: %s: %s", type(error).__name__, error, exc_info=error)
        self.dead_error = error
        self._fail_all(EngineDeadError(f"the engine died: {error}"))
        self._publish()
        if self.on_dead is not None:
            self.on_dead(error)

    def _fail_all(self, error: BaseException) -> None:
        for request_id in self.engine.outputs.request_ids():
            try:
                self.engine.abort_request(request_id)
            except Exception:  # a dead engine's state may be inconsistent; streams still end
                logger.exception("abort of %s failed", request_id)
            self._deliver(request_id, error)
