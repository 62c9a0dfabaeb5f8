"""What both OpenAI endpoints share: errors in the OpenAI shape, running several generations
at once while watching for the client to go away, SSE framing and usage counting."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse

from tokenmill.engine.async_engine import AsyncLLM
from tokenmill.outputs import CompletionOutput, RequestOutput
from tokenmill.sampling_params import SamplingParams
from tokenmill.server.protocol import ErrorBody, ErrorResponse, UsageInfo

_ERROR_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError",
                503: "ServiceUnavailableError", 500: "InternalServerError"}
_DISCONNECT_POLL_S = 0.1


class ClientDisconnected(Exception):
    pass


def error_response(status: int, message: str, param: str | None = None) -> JSONResponse:
    if param is None:  # our ValueErrors start with the field they are about
        m = re.match(r"([a-z_]+) must", message)
        param = m.group(1) if m else None
    body = ErrorResponse(error=ErrorBody(message=message, type=_ERROR_TYPES.get(status, "Error"),
                                         param=param, code=status))
    return JSONResponse(body.model_dump(), status_code=status)


def sse(payload: dict[str, Any] | str) -> str:
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)
    return f"data: {data}\n\n"


class DeltaTracker:
    """How much of each streamed choice the client has already been sent."""

    def __init__(self) -> None:
        self._sent: dict[int, tuple[int, int]] = {}  # choice index → (chars, tokens)

    def advance(self, index: int, c: CompletionOutput) -> tuple[int, int] | None:
        """(chars, tokens) sent before, and marks everything sent; None if nothing is new."""
        t0, k0 = self._sent.get(index, (0, 0))
        if len(c.text) == t0 and len(c.token_ids) == k0 and c.finish_reason is None:
            return None
        self._sent[index] = (len(c.text), len(c.token_ids))
        return t0, k0


def usage(outputs: list[RequestOutput]) -> UsageInfo:
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    completion = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    return UsageInfo(prompt_tokens=prompt, completion_tokens=completion,
                     total_tokens=prompt + completion)


async def add_all(engine: AsyncLLM, request_id: str, prompts: list[Any],
                  params: SamplingParams) -> list[AsyncIterator[RequestOutput]]:
    """Queue one request per prompt; if any is refused, abort those already queued."""
    streams = []
    try:
        for i, prompt in enumerate(prompts):
            streams.append(await engine.add_request(f"{request_id}-{i}", prompt, params))
    except BaseException:
        for i in range(len(streams)):
            engine.abort(f"{request_id}-{i}")
        raise
    return streams


async def merge(generators: list[AsyncIterator[RequestOutput]]
                ) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Interleave several output streams as (index, output); cancelling the consumer cancels
    every producer, which aborts their requests."""
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(i: int, gen: AsyncIterator[RequestOutput]) -> None:
        try:
            async for out in gen:
                await queue.put((i, out))
            await queue.put((i, done))
        except Exception as e:  # handed to the consumer, which raises it
            await queue.put((i, e))

    tasks = [asyncio.create_task(pump(i, g)) for i, g in enumerate(generators)]
    remaining = len(tasks)
    try:
        while remaining:
            i, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def collect(generators: list[AsyncIterator[RequestOutput]],
                  raw_request: Request) -> list[RequestOutput]:
    """Final output of each generator; ClientDisconnected (after aborting them all) if the
    client leaves first."""
    finals: list[RequestOutput | None] = [None] * len(generators)

    async def run() -> None:
        async for i, out in merge(generators):
            finals[i] = out

    task = asyncio.create_task(run())
    try:
        while not task.done():
            await asyncio.wait([task], timeout=_DISCONNECT_POLL_S)
            if not task.done() and await raw_request.is_disconnected():
                raise ClientDisconnected
        task.result()
    finally:
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    return [f for f in finals if f is not None]
