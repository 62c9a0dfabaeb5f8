"""RequestStream: the outputs of one request, read on the event loop (AsyncLLM's streams).

The engine thread hands each step's outputs to the event loop (`put`, run there); the reader
takes them with `async for`. A reader slower than the steps finds several outputs waiting:
they are taken as one (`outputs.coalesce`: the latest for CUMULATIVE and FINAL_ONLY, joined
for DELTA), so a loaded event loop sends one event per wake-up rather than one per step, and
what a reader sees does not depend on how far behind it was. An error handed in after outputs
is raised once those outputs have been read.

Cancelled while waiting, closed, or garbage-collected before its last output, a stream
aborts its request (so its KV blocks are freed), even if it was never iterated: an async
generator that never started would run no `finally` at all.
"""

from __future__ import annotations

import asyncio
from typing import Protocol

from tokenmill.outputs import EmbeddingRequestOutput, RequestOutput, coalesce
from tokenmill.sampling_params import RequestOutputKind

Output = RequestOutput | EmbeddingRequestOutput


class StreamOwner(Protocol):
    def abort(self, request_id: str) -> None: ...

    def stream_ended(self, request_id: str) -> None: ...


class RequestStream:
    def __init__(self, owner: StreamOwner, request_id: str, kind: RequestOutputKind) -> None:
        self.owner, self.request_id = owner, request_id
        self._delta = kind is RequestOutputKind.DELTA
        self._pending: Output | None = None  # what has come and not been read, coalesced
        self._error: BaseException | None = None
        self._ready = asyncio.Event()
        self._done = False

    def put(self, item: Output | BaseException) -> None:
        """Take one output (or the error that ends the request); on the stream's event loop."""
        if isinstance(item, BaseException):
            self._error = item
        elif self._pending is None or isinstance(item, EmbeddingRequestOutput):
            self._pending = item
        else:
            self._pending = coalesce(self._pending, item, self._delta)
        self._ready.set()

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> Output:
        if self._done:
            raise StopAsyncIteration
        if self._pending is None and self._error is None:
            try:
                await self._ready.wait()
            except BaseException:  # cancelled: the reader went away
                self.close()
                raise
        self._ready.clear()
        out, self._pending = self._pending, None
        if out is None:
            self.close()
            raise self._error
        if out.finished:
            self._done = True
            self.owner.stream_ended(self.request_id)
        return out

    def close(self) -> None:
        if not self._done:
            self._done = True
            self.owner.abort(self.request_id)

    async def aclose(self) -> None:
        self.close()

    def __del__(self) -> None:
        self.close()
