"""HttpOptions: how a server meets browsers, proxies and TLS (`tokenmill serve` flags under
vLLM's names): CORS (vLLM's defaults: any origin, method and header, no credentials), the
root path behind a path-routing proxy, the OpenAPI docs routes, and uvicorn's TLS files.

CORS answers a browser's preflight before anything else runs (the API key is checked per
route, and a preflight carries none), so its middleware is the outermost.
"""

from __future__ import annotations

import json
import ssl
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware


def json_list(value: str) -> list[str]:
    """An argparse type: vLLM's JSON list flags (e.g. '["https://a.example"]')."""
    try:
        items = json.loads(value)
    except json.JSONDecodeError as e:
        raise ValueError(f"expected a JSON list of strings, got {value!r}") from e
    if not isinstance(items, list) or not all(isinstance(i, str) for i in items):
        raise ValueError(f"expected a JSON list of strings, got {value!r}")
    return items


@dataclass(frozen=True)
class HttpOptions:
    allowed_origins: tuple[str, ...] = ("*",)
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)
    allow_credentials: bool = False
    root_path: str = ""
    docs: bool = True  # /docs, /redoc and /openapi.json (--disable-fastapi-docs: none)
    ssl_keyfile: str | None = None
    ssl_certfile: str | None = None
    ssl_ca_certs: str | None = None
    ssl_cert_reqs: int = int(ssl.CERT_NONE)

    def __post_init__(self) -> None:
        if (self.ssl_keyfile is None) != (self.ssl_certfile is None):
            raise ValueError("--ssl-keyfile and --ssl-certfile go together")
        if self.ssl_cert_reqs not in (ssl.CERT_NONE, ssl.CERT_OPTIONAL, ssl.CERT_REQUIRED):
            raise ValueError(f"ssl_cert_reqs must be 0, 1 or 2 (ssl.CERT_*), got "
                             f"{self.ssl_cert_reqs}")

    def app_kwargs(self) -> dict[str, Any]:
        """FastAPI's keywords for the root path and the docs routes."""
        docs = {} if self.docs else {"openapi_url": None, "docs_url": None, "redoc_url": None}
        return {"root_path": self.root_path, **docs}

    def add_cors(self, app: FastAPI) -> None:
        """Called last: the outermost middleware."""
        app.add_middleware(CORSMiddleware, allow_origins=list(self.allowed_origins),
                           allow_methods=list(self.allowed_methods),
                           allow_headers=list(self.allowed_headers),
                           allow_credentials=self.allow_credentials)

    def uvicorn_kwargs(self) -> dict[str, Any]:
        """uvicorn.Config's TLS keywords (none without a key and certificate)."""
        if self.ssl_keyfile is None:
            return {}
        return {"ssl_keyfile": self.ssl_keyfile, "ssl_certfile": self.ssl_certfile,
                "ssl_ca_certs": self.ssl_ca_certs, "ssl_cert_reqs": self.ssl_cert_reqs}
