"""`tokenmill proxy`: disaggregated prefill / decode in front of OpenAI servers, as vLLM's
disaggregated-serving proxy.

Each completion or chat request goes first to a prefill instance (a kv_producer) with
`max_tokens` 1 and no streaming: computing the prompt writes its KV blocks to the shared
storage (kv_offload/). Then the request as sent goes to a decode instance (a kv_consumer),
which finds those blocks, computes only the prompt's tail, and decodes; its answer (streamed
or not) is passed back as it comes. Instances are taken in turn.

A prefill that fails (unreachable, 5xx) costs nothing but time: the decode instance computes
the prompt itself, so a missing transfer is never a wrong answer. A prefill that refuses the
request (4xx) is the client's error and is returned as is. Authorization headers are passed
on to both.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
from collections.abc import AsyncIterator

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

logger = logging.getLogger(__name__)

_FORWARDED_HEADERS = ("authorization", "x-api-key")


def _error(status: int, message: str, kind: str = "invalid_request_error") -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "param": None,
                                   "code": status}}, status_code=status)


def prefill_body(body: dict) -> dict:
    """The request a prefill instance gets: the same prompt, one token, no stream."""
    out = {k: v for k, v in body.items() if k not in ("stream_options", "n", "best_of")}
    out.update(max_tokens=1, stream=False)
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    return out


class DisaggProxy:
    """The instances (taken in turn) and one HTTP client to them."""

    def __init__(self, prefill_urls: list[str], decode_urls: list[str],
                 timeout: float | None = None) -> None:
        if not prefill_urls or not decode_urls:
            raise ValueError("the proxy needs at least one --prefill and one --decode URL")
        self.urls = list(dict.fromkeys(u.rstrip("/") for u in [*prefill_urls, *decode_urls]))
        self.prefill_turn = itertools.cycle([u.rstrip("/") for u in prefill_urls])
        self.decode_turn = itertools.cycle([u.rstrip("/") for u in decode_urls])
        self.client = httpx.AsyncClient(timeout=timeout)
        self.prefill_failures = 0

    async def relay(self, raw: Request, path: str) -> Response:
        """A completion or chat request: prefilled, then decoded (module doc)."""
        try:
            body = json.loads(await raw.body())
        except ValueError as e:
            return _error(400, f"the body is not JSON: {e}")
        if not isinstance(body, dict):
            return _error(400, "the body must be a JSON object")
        headers = _forwarded(raw)
        refused = await self._prefill(f"{next(self.prefill_turn)}{path}", body, headers)
        if refused is not None:
            return refused
        return await self._decode(f"{next(self.decode_turn)}{path}", body, headers)

    async def _prefill(self, url: str, body: dict, headers: dict) -> Response | None:
        """None when the decode instance should go on (prefilled, or failed: it computes the
        prompt itself); the prefill's answer when it refused the request (4xx)."""
        try:
            r = await self.client.post(url, json=prefill_body(body), headers=headers)
        except httpx.HTTPError as e:
            self.prefill_failures += 1
            logger.warning("prefill at %s failed (%s): the decode instance computes the "
                           "prompt", url, e)
            return None
        if 400 <= r.status_code < 500:
            return Response(r.content, r.status_code, media_type=r.headers.get("content-type"))
        if r.status_code >= 500:
            self.prefill_failures += 1
            logger.warning("prefill at %s answered %d: the decode instance computes the "
                           "prompt", url, r.status_code)
        return None

    async def _decode(self, url: str, body: dict, headers: dict) -> Response:
        try:
            r = await self.client.send(self.client.build_request("POST", url, json=body,
                                                                 headers=headers), stream=True)
        except httpx.HTTPError as e:
            return _error(502, f"the decode instance {url} is unreachable: {e}", "server_error")
        media = r.headers.get("content-type")
        if not body.get("stream") or r.status_code != 200:
            content = await r.aread()
            await r.aclose()
            return Response(content, r.status_code, media_type=media)

        async def chunks() -> AsyncIterator[bytes]:
            try:
                async for chunk in r.aiter_raw():
                    yield chunk
            finally:
                await r.aclose()

        return StreamingResponse(chunks(), r.status_code, media_type=media)

    async def models(self, raw: Request) -> Response:
        url = f"{next(self.decode_turn)}/v1/models"
        try:
            r = await self.client.get(url, headers=_forwarded(raw))
        except httpx.HTTPError as e:
            return _error(502, f"the decode instance {url} is unreachable: {e}", "server_error")
        return Response(r.content, r.status_code, media_type=r.headers.get("content-type"))

    async def health(self) -> Response:
        """200 when every instance answers its /health with 200."""
        down = []
        for url in self.urls:
            try:
                ok = (await self.client.get(f"{url}/health")).status_code == 200
            except httpx.HTTPError:
                ok = False
            if not ok:
                down.append(url)
        if down:
            return _error(503, f"unhealthy instances: {', '.join(down)}", "server_error")
        return Response(status_code=200)


def _forwarded(raw: Request) -> dict[str, str]:
    return {k: v for k, v in raw.headers.items() if k.lower() in _FORWARDED_HEADERS}


def build_proxy_app(prefill_urls: list[str], decode_urls: list[str],
                    timeout: float | None = None) -> FastAPI:
    proxy = DisaggProxy(prefill_urls, decode_urls, timeout)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        await proxy.client.aclose()

    app = FastAPI(title="tokenmill disaggregated prefill proxy", lifespan=lifespan)
    app.state.proxy = proxy

    @app.post("/v1/completions")
    async def completions(raw: Request) -> Response:
        return await proxy.relay(raw, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat(raw: Request) -> Response:
        return await proxy.relay(raw, "/v1/chat/completions")

    @app.get("/v1/models")
    async def models(raw: Request) -> Response:
        return await proxy.models(raw)

    @app.get("/health")
    async def health() -> Response:
        return await proxy.health()

    return app
