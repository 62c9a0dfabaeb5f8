"""EdgeMiddleware: what every HTTP request goes through before a route sees it.

- Request ids: the client's `X-Request-Id` (printable ASCII, at most 128 characters) or a new
  one; set in `request_context` for the request's log lines and returned in the response's
  `X-Request-Id` header.
- Body size: a body over `max_body_bytes` is refused with 413 before it is read whole (by its
  Content-Length, or as soon as the streamed bytes pass the limit).
- Draining: while the server shuts down, every route but /health and /metrics answers 503.
- Overload: while admission control is full, a request to a generation route gets its 429
  here, before its body is read or parsed: at a thousand connections at once, the refusals'
  parsing was what kept the event loop (and /health) waiting.
- One access-log line per request: method, path, status, duration, and the request id.

A pure ASGI middleware, not Starlette's BaseHTTPMiddleware, which hides client disconnects
from streaming responses.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from starlette.datastructures import Headers

from tokenmill.server.serving_common import error_body
from tokenmill.utils import request_context

logger = logging.getLogger("tokenmill.access")

Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
_ALWAYS_OPEN = ("/health", "/metrics")
# the routes admission control bounds (server/admission.py)
_ADMITTED = ("/v1/completions", "/v1/chat/completions", "/v1/embeddings")


def _client_request_id(headers: Headers) -> str | None:
    text = headers.get("x-request-id", "")
    return text if 0 < len(text) <= 128 and text.isascii() and text.isprintable() else None


def _content_length(headers: Headers) -> int | None:
    try:
        return int(headers["content-length"])
    except (KeyError, ValueError):
        return None


async def send_error(send: Send, status: int, message: str, request_id: str,
                     headers: dict[str, str] | None = None) -> None:
    body = json.dumps(error_body(status, message)).encode()
    raw = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
           (b"x-request-id", request_id.encode())]
    raw += [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": body})


class EdgeMiddleware:
    def __init__(self, app: Callable, max_body_bytes: int, is_draining: Callable[[], bool],
                 overloaded: Callable[[], str | None] = lambda: None,
                 retry_after_s: int = 1, access_log: bool = True) -> None:
        """overloaded(): why admission control refuses every request now, or None;
        access_log: a line per request (method, path, status, seconds)."""
        self.app, self.max_body_bytes, self.is_draining = app, max_body_bytes, is_draining
        self.overloaded, self.retry_after_s = overloaded, retry_after_s
        self.access_log = access_log

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = Headers(scope=scope)
        rid = _client_request_id(headers) or uuid.uuid4().hex
        token = request_context.request_id.set(rid)
        start, status = time.perf_counter(), [0]
        try:
            if self.is_draining() and scope["path"] not in _ALWAYS_OPEN:
                status[0] = 503
                return await send_error(send, 503, "the server is shutting down", rid,
                                        {"connection": "close"})
            if scope["method"] == "POST" and scope["path"] in _ADMITTED and \
                    (why := self.overloaded()) is not None:
                status[0] = 429
                return await send_error(send, 429, why, rid,
                                        {"retry-after": str(self.retry_after_s)})
            length = _content_length(headers)
            if length is not None and length > self.max_body_bytes:
                status[0] = 413
                return await send_error(send, 413, self._too_large(length), rid,
                                        {"connection": "close"})
            await self._call_app(scope, receive, send, rid, status)
        finally:
            if self.access_log:
                logger.info("%s %s %d %.3fs", scope["method"], scope["path"], status[0],
                            time.perf_counter() - start)
            request_context.request_id.reset(token)

    def _too_large(self, length: int) -> str:
        return (f"request body of {length} bytes exceeds the limit of {self.max_body_bytes} "
                "bytes (--max-request-body-bytes)")

    async def _call_app(self, scope: Scope, receive: Receive, send: Send, rid: str,
                        status: list[int]) -> None:
        received, too_large = 0, False

        async def counted_receive() -> Message:
            # Past the limit the app sees a disconnect, whatever it makes of that; the
            # response it starts is then replaced by the 413.
            nonlocal received, too_large
            if too_large:
                return {"type": "http.disconnect"}
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_body_bytes:
                    too_large = True
                    return {"type": "http.disconnect"}
            return message

        async def tagged_send(message: Message) -> None:
            if too_large:
                if message["type"] == "http.response.start":
                    status[0] = 413
                    await send_error(send, 413, self._too_large(received), rid,
                                     {"connection": "close"})
                return
            if message["type"] == "http.response.start":
                status[0] = message["status"]
                message = dict(message)
                message["headers"] = [*message.get("headers", []),
                                      (b"x-request-id", rid.encode())]
            await send(message)

        await self.app(scope, counted_receive, tagged_send)
