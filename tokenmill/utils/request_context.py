"""The id of the HTTP request being served, for log lines.

The server's middleware sets `request_id` (from the client's X-Request-Id header, or a new
one) for the duration of each request; `RequestIdFilter` puts it on every log record as
`%(request_id)s` ("-" outside a request, e.g. on the engine thread, whose lines name their
request themselves). Prompts are never logged.
"""

from __future__ import annotations

import contextvars
import logging

request_id: contextvars.ContextVar[str] = contextvars.ContextVar("request_id", default="-")


class RequestIdFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        record.request_id = request_id.get()
        return True
