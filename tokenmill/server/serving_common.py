"""What both OpenAI endpoints share: errors in the OpenAI shape, running several generations
at once while watching for the client to go away, SSE framing (with an error event for a
request that fails after its stream began), and usage counting."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import json
import re
import time
from collections.abc import AsyncIterator, Mapping
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse

from tokenmill.engine.async_engine import AsyncLLM, EngineDeadError
from tokenmill.lora.request import LoRARequest
from tokenmill.outputs import CompletionOutput, RequestOutput
from tokenmill.sampling_params import SamplingParams
from tokenmill.server.admission import AdmissionControl, Ticket
from tokenmill.server.protocol import (
    ErrorBody,
    ErrorResponse,
    PromptTokensDetails,
    StreamOptions,
    UsageInfo,
)
from tokenmill.server.request_log import RequestLog
from tokenmill.utils import request_context

_ERROR_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError",
                405: "MethodNotAllowedError", 413: "RequestTooLargeError",
                422: "UnprocessableEntityError", 429: "RateLimitError",
                500: "InternalServerError", 503: "ServiceUnavailableError"}
# "<field> must ...", also of a part of one: "tools[0].function.parameters must ..." → tools
_PARAM_IN_MESSAGE = re.compile(r"([a-z_]+)(?:\[\d+\]|\.[a-z_]+)* (must|is not supported|is only "
                               r"allowed|is not available|is invalid)")


class ClientDisconnected(Exception):
    pass


class RequestFailed(Exception):
    """The engine failed on this request alone (its output carries the error)."""


def error_body(status: int, message: str, param: str | None = None) -> dict[str, Any]:
    if param is None:  # our ValueErrors start with the field they are about
        m = _PARAM_IN_MESSAGE.match(message)
        param = m.group(1) if m else None
    return ErrorResponse(error=ErrorBody(message=message, type=_ERROR_TYPES.get(status, "Error"),
                                         param=param, code=status)).model_dump()


def error_response(status: int, message: str, param: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param), status_code=status, headers=headers)


# OpenAPI: a generation route answers JSON, or server-sent events when the request streams
STREAMED: dict[int | str, dict[str, Any]] = {200: {
    "description": "The answer (JSON), or its events (stream: true)",
    "content": {"application/json": {}, "text/event-stream": {}}}}


def check_failed(outputs: list[RequestOutput]) -> None:
    """RequestFailed if the engine failed any of these requests."""
    for out in outputs:
        if out.error is not None:
            raise RequestFailed(f"the engine failed on this request: {out.error}")


def sse_error(error: BaseException) -> str:
    """The event that ends a stream which failed after it began (then [DONE] follows)."""
    status = (400 if isinstance(error, ValueError)
              else 503 if isinstance(error, EngineDeadError) else 500)
    return sse(error_body(status, str(error)))


def sse(payload: dict[str, Any] | str) -> str:
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)
    return f"data: {data}\n\n"


@dataclasses.dataclass
class ChoiceSoFar:
    """A streamed choice (one sample) as its outputs have built it up so far: a stream asks
    for DELTA outputs (each holds only what is new, as vLLM's server does), so nothing the
    engine sends grows with the answer; what needs the whole (tool calls found in the text,
    the usage counts) reads it here."""

    index: int
    text: str = ""
    token_ids: list[int] = dataclasses.field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


@dataclasses.dataclass(frozen=True)
class StreamUsage:
    """Which chunks of a stream carry usage (`stream_options`)."""

    final: bool = False  # include_usage: a last chunk, with no choices, for the whole request
    continuous: bool = False  # continuous_usage_stats: every chunk, its choice's so far

    @classmethod
    def of(cls, options: StreamOptions | None, force: bool = False) -> StreamUsage:
        """force (--enable-force-include-usage): a last usage chunk whatever was asked."""
        if options is None or not options.include_usage:
            return cls(final=force)
        return cls(final=True, continuous=options.continuous_usage_stats)


class StreamedChoices:
    """Every choice of a stream so far, built from its DELTA outputs."""

    def __init__(self) -> None:
        self.choices: dict[int, ChoiceSoFar] = {}  # choice index → the choice so far
        self._prompt_tokens: dict[int, int] = {}  # prompt index → its length
        self._cached: dict[int, int] = {}  # prompt index → its tokens found cached

    def add(self, prompt: int, index: int, out: RequestOutput, new: CompletionOutput
            ) -> ChoiceSoFar:
        """`new` (a sample of `out`, the stream's output for prompt `prompt`) added to choice
        `index`; the choice so far."""
        self._prompt_tokens[prompt] = len(out.prompt_token_ids)
        if out.num_cached_tokens is not None:
            self._cached[prompt] = out.num_cached_tokens
        c = self.choices.setdefault(index, ChoiceSoFar(index))
        c.text += new.text
        c.token_ids += new.token_ids
        c.finish_reason, c.stop_reason = new.finish_reason, new.stop_reason
        return c

    def choice_usage(self, prompt: int, index: int, details: bool = False) -> dict[str, Any]:
        """Choice `index` (of prompt `prompt`)'s usage so far, as vLLM's continuous usage
        stats count it: its prompt's tokens and its own (details: its cached tokens)."""
        p, c = self._prompt_tokens[prompt], self.choices[index].num_tokens
        return _usage_info(p, c, self._cached.get(prompt, 0) if details else None).model_dump()

    def usage(self, details: bool = False) -> UsageInfo:
        """The whole stream's (details: with the prompts' cached tokens)."""
        completion = sum(c.num_tokens for c in self.choices.values())
        return _usage_info(sum(self._prompt_tokens.values()), completion,
                           sum(self._cached.values()) if details else None)


def token_name(token_id: int, text: str | None, as_ids: bool) -> str | None:
    """A logprob's token as the API shows it: its text, or "token_id:N" (vLLM's
    return_tokens_as_token_ids: every token identifiable, whatever its bytes)."""
    return f"token_id:{token_id}" if as_ids else text


def prompt_logprobs_json(out: RequestOutput) -> list[dict[str, Any] | None] | None:
    """vLLM's `prompt_logprobs`: per prompt position (None first), token id → logprob."""
    if out.prompt_logprobs is None:
        return None
    return [None if entry is None else
            {str(tid): {"logprob": lp.logprob, "rank": lp.rank, "decoded_token": lp.decoded_token}
             for tid, lp in entry.items()} for entry in out.prompt_logprobs]


def usage(outputs: list[RequestOutput], details: bool = False) -> UsageInfo:
    """The requests' token counts (details: with their prompts' cached tokens)."""
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    completion = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    cached = sum(o.num_cached_tokens or 0 for o in outputs) if details else None
    return _usage_info(prompt, completion, cached)


def _usage_info(prompt: int, completion: int, cached: int | None) -> UsageInfo:
    return UsageInfo(prompt_tokens=prompt, completion_tokens=completion,
                     total_tokens=prompt + completion,
                     prompt_tokens_details=(None if cached is None
                                            else PromptTokensDetails(cached_tokens=cached)))


@dataclasses.dataclass(frozen=True)
class ServingOptions:
    """What the generation routes add to their answers (`tokenmill serve` flags, vLLM's)."""

    request_log: RequestLog | None = None  # --enable-log-requests; None: not logged
    prompt_tokens_details: bool = False  # --enable-prompt-tokens-details: cached_tokens
    force_include_usage: bool = False  # --enable-force-include-usage: every stream's usage
    response_role: str = "assistant"  # --response-role: chat answers' role
    # --return-tokens-as-token-ids: logprobs name tokens "token_id:N" (a request may ask too)
    tokens_as_ids: bool = False
    trust_request_chat_template: bool = False  # --trust-request-chat-template


class OpenAIServing:
    """What the completions and chat handlers share: admission, deadlines and queueing."""

    def __init__(self, engine: AsyncLLM, model_name: str, admission: AdmissionControl,
                 request_timeout: float | None = None,
                 options: ServingOptions | None = None) -> None:
        self.engine, self.model_name = engine, model_name
        self.admission, self.request_timeout = admission, request_timeout
        self.options = options or ServingOptions()

    @property
    def details(self) -> bool:
        """Whether usage carries the prompts' cached tokens."""
        return self.options.prompt_tokens_details

    def as_ids(self, req: Any) -> bool:
        """Whether the request's logprobs name tokens "token_id:N": its own field (vLLM's
        return_tokens_as_token_ids), else the server's flag."""
        asked = req.return_tokens_as_token_ids
        return self.options.tokens_as_ids if asked is None else asked

    def stream_usage(self, options: StreamOptions | None) -> StreamUsage:
        return StreamUsage.of(options, self.options.force_include_usage)

    @property
    def sampling_defaults(self) -> Mapping[str, Any]:
        """What a request's unset sampling values take (the model's generation config)."""
        return self.engine.engine.config.model.sampling_defaults

    def response_id(self, prefix: str) -> str:
        """`prefix-<X-Request-Id>` (the middleware makes one up when the client sent none)."""
        return f"{prefix}-{request_context.request_id.get()}"

    def admit(self, num_prompts: int, params: SamplingParams) -> Ticket:
        return self.admission.admit(num_prompts * params.n)

    def deadline(self, timeout: float | None) -> float | None:
        """The request's deadline: its own timeout or the server's, whichever is shorter."""
        limits = [t for t in (timeout, self.request_timeout) if t is not None]
        return time.monotonic() + min(limits) if limits else None

    def served_name(self, lora: LoRARequest | None) -> str:
        """The `model` the response names: the adapter's, or the served model's."""
        return self.model_name if lora is None else lora.lora_name

    async def add_all(self, prompts: list[Any], params: SamplingParams,
                      timeout: float | None, lora: LoRARequest | None = None,
                      priority: int = 0) -> list[AsyncIterator[RequestOutput]]:
        """Queue one request per prompt (with the adapter `model` named); if any is refused,
        abort those already queued."""
        base = f"{request_context.request_id.get()}-{next(_engine_ids)}"
        deadline = self.deadline(timeout)
        streams = []
        try:
            for i, prompt in enumerate(prompts):
                if self.options.request_log is not None:
                    self.options.request_log.log(f"{base}-{i}", prompt, params, lora)
                streams.append(await self.engine.add_request(f"{base}-{i}", prompt, params,
                                                             deadline, lora, priority))
        except BaseException:
            for i in range(len(streams)):
                self.engine.abort(f"{base}-{i}")
            raise
        return streams


_engine_ids = itertools.count()  # engine ids stay unique when clients reuse X-Request-Id


async def merge(generators: list[AsyncIterator[RequestOutput]]
                ) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Interleave several output streams as (index, output); closing or cancelling the
    consumer closes every stream, which aborts their requests.

    Nothing is read ahead of the consumer: a stream's outputs wait in the stream, which takes
    them as one (engine/request_stream.py), while the consumer writes to a slow client. A
    single stream is read directly; several hand over through a one-place queue."""
    if len(generators) == 1:
        gen = generators[0]
        try:
            async for out in gen:
                yield 0, out
        finally:
            await _close(gen)
        return
    queue: asyncio.Queue = asyncio.Queue(maxsize=1)
    done = object()

    async def pump(i: int, gen: AsyncIterator[RequestOutput]) -> None:
        try:
            async for out in gen:
                await queue.put((i, out))
            await queue.put((i, done))
        except Exception as e:  # handed to the consumer, which raises it
            await queue.put((i, e))
        finally:
            await _close(gen)

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


async def _close(gen: AsyncIterator[RequestOutput]) -> None:
    """End a stream (an unfinished request is aborted; a finished one, nothing)."""
    aclose = getattr(gen, "aclose", None)
    if aclose is not None:
        await aclose()


async def collect(generators: list[AsyncIterator[RequestOutput]],
                  raw_request: Request) -> list[RequestOutput]:
    """Final output of each generator; ClientDisconnected (after aborting them all) if the
    client leaves first."""
    finals: list[RequestOutput | None] = [None] * len(generators)

    async def run() -> None:
        async for i, out in merge(generators):
            finals[i] = out

    task = asyncio.create_task(run())
    # One waiter per request, asleep until the client goes (polling every request for its
    # connection cost the event loop most of its time with hundreds waiting)
    gone = asyncio.create_task(wait_for_disconnect(raw_request))
    try:
        await asyncio.wait([task, gone], return_when=asyncio.FIRST_COMPLETED)
        if not task.done():
            raise ClientDisconnected
        task.result()
    finally:
        for t in (task, gone):
            if not t.done():
                t.cancel()
        await asyncio.gather(task, gone, return_exceptions=True)
    return [f for f in finals if f is not None]


async def wait_for_disconnect(raw_request: Request) -> None:
    """Return when the client disconnects (its body already read: the server's next message
    is the disconnect, which it sends when the connection is lost)."""
    while (await raw_request.receive())["type"] != "http.disconnect":
        pass
