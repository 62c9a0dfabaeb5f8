"""POST /v1/completions: one or several prompts (text or token ids), n samples each, streamed
as Server-Sent Events or returned whole. Choice index = prompt index * n + sample index.

A stream always ends with [DONE]: after each choice's finish_reason ("abort" for a deadline or a
shutdown), or after an error event if the engine failed the request."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from tokenmill.lora.request import LoRARequest
from tokenmill.outputs import CompletionOutput, PositionLogprobDict, RequestOutput
from tokenmill.server.admission import Ticket
from tokenmill.server.protocol import CompletionRequest
from tokenmill.server.serving_common import (
    OpenAIServing,
    StreamedChoices,
    StreamUsage,
    check_failed,
    collect,
    merge,
    prompt_logprobs_json,
    sse,
    sse_error,
    token_name,
    usage,
)


def completion_logprobs(token_ids: Sequence[int],
                        entries: Sequence[PositionLogprobDict | None] | None, top_k: int,
                        decode: Callable[[int], str], text_offset: int = 0,
                        as_ids: bool = False) -> tuple[dict[str, Any] | None, int]:
    """OpenAI's legacy completions logprobs of `token_ids` (a stream's: its new ones), each
    with its logprob entry (None: it has none, as an echoed prompt's first token) and at most
    `top_k` alternatives; their text offsets counted from `text_offset` (the decoded tokens'
    lengths); and the offset after them, where a stream's next tokens start. A logprob of
    -inf is sent as -9999.0, as vLLM does (JSON has no infinity). as_ids (vLLM's
    return_tokens_as_token_ids): each token named "token_id:N" instead of its text."""
    if entries is None:
        return None, text_offset
    tokens, token_lps, tops, offsets = [], [], [], []
    offset = text_offset
    for tid, entry in zip(token_ids, entries, strict=True):
        if entry is None:
            token, logprob, top = token_name(tid, decode(tid), as_ids), None, None
        else:
            token = token_name(tid, entry[tid].decoded_token, as_ids)
            logprob = _finite(entry[tid].logprob)
            top = {token_name(t, lp.decoded_token, as_ids): _finite(lp.logprob)
                   for t, lp in entry.items() if lp.rank <= top_k or t == tid}
        tokens.append(token)
        token_lps.append(logprob)
        tops.append(top)
        offsets.append(offset)
        offset += len(token or "")
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops,
            "text_offset": offsets}, offset


def _finite(logprob: float) -> float:
    return max(logprob, -9999.0)


class Echo:
    """echo (vLLM's, OpenAI's legacy field): each choice's first output is prefixed with its
    prompt (the text as sent, or the token ids decoded) and, with logprobs, the prompt's
    logprobs (computed for it: CompletionRequest.to_sampling_params); with max_tokens 0 the
    prompt alone is the choice (the one token computed is not shown, but counted in usage, as
    vLLM does). Without echo, outputs pass through."""

    def __init__(self, req: CompletionRequest, tokenizer: Any) -> None:
        self.on, self.only = req.echo, req.echo_only
        self.with_logprobs = req.logprobs is not None
        self.tokenizer = tokenizer
        self._started: set[int] = set()  # choices whose prompt has been echoed
        self._prompt_logprobs: dict[int, list[PositionLogprobDict | None]] = {}

    def apply(self, i: int, idx: int, out: RequestOutput, c: CompletionOutput
              ) -> tuple[str, list[int], list[PositionLogprobDict | None] | None]:
        """Choice `idx` (of prompt `i`)'s text, token ids and logprob entries for output
        `c` (a stream's: what is new)."""
        if not self.on:
            return c.text, list(c.token_ids), c.logprobs
        if out.prompt_logprobs is not None:  # (a stream's first output of the prompt)
            self._prompt_logprobs[i] = out.prompt_logprobs
        if idx in self._started:
            return ("", [], None) if self.only else (c.text, list(c.token_ids), c.logprobs)
        self._started.add(idx)
        ids = list(out.prompt_token_ids)
        text = out.prompt if out.prompt is not None else self.tokenizer.decode(ids)
        lps = self._prompt_logprobs.get(i) if self.with_logprobs else None
        if self.only:
            return text, ids, lps
        both = None if lps is None or c.logprobs is None else [*lps, *c.logprobs]
        return text + c.text, [*ids, *c.token_ids], both

    def decode_token(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])


class OpenAIServingCompletion(OpenAIServing):
    async def create(self, req: CompletionRequest, raw: Request,
                     lora: LoRARequest | None = None) -> Any:
        if req.suffix:
            raise ValueError("suffix is not supported by tokenmill yet")
        params = req.to_sampling_params(self.sampling_defaults)
        prompts = req.prompts()
        ticket = self.admit(len(prompts), params)
        try:
            request_id = self.response_id("cmpl")
            gens = await self.add_all(prompts, params, req.timeout, lora, req.priority)
            if req.stream:
                echo = Echo(req, self.engine.engine.tokenizer)
                return StreamingResponse(self._stream(request_id, gens, params.n,
                                                      self.stream_usage(req.stream_options),
                                                      ticket, self.served_name(lora), echo,
                                                      req.logprobs or 0, self.as_ids(req)),
                                         media_type="text/event-stream")
            finals = await collect(gens, raw)
        except BaseException:
            ticket.release()
            raise
        ticket.release()
        check_failed(finals)
        choices = []
        echo, top_k = Echo(req, self.engine.engine.tokenizer), req.logprobs or 0
        for i, out in enumerate(finals):
            for c in out.outputs:
                text, ids, entries = echo.apply(i, i * params.n + c.index, out, c)
                choice = {"index": i * params.n + c.index, "text": text,
                          "logprobs": completion_logprobs(ids, entries, top_k,
                                                          echo.decode_token,
                                                          as_ids=self.as_ids(req))[0],
                          "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
                if out.prompt_logprobs is not None:
                    choice["prompt_logprobs"] = prompt_logprobs_json(out)
                choices.append(choice)
        return JSONResponse({"id": request_id, "object": "text_completion",
                             "created": int(time.time()), "model": self.served_name(lora),
                             "choices": choices,
                             "usage": usage(finals, self.details).model_dump()})

    async def _stream(self, request_id: str, gens: list[AsyncIterator[RequestOutput]], n: int,
                      stream_usage: StreamUsage, ticket: Ticket, model: str, echo: Echo,
                      top_k: int, as_ids: bool) -> AsyncIterator[str]:
        created = int(time.time())
        streamed = StreamedChoices()
        # choice index → its next token's text offset, counted as the whole answer counts
        # it (the visible text may hold a partial character back)
        offsets: dict[int, int] = {}
        try:  # the ticket is released however the stream ends
            try:
                async for i, out in merge(gens):
                    check_failed([out])
                    for c in out.outputs:  # (DELTA: the new text, tokens and logprobs)
                        idx = i * n + c.index
                        streamed.add(i, idx, out, c)
                        text, ids, entries = echo.apply(i, idx, out, c)
                        logprobs, offsets[idx] = completion_logprobs(
                            ids, entries, top_k, echo.decode_token, offsets.get(idx, 0),
                            as_ids)
                        chunk = {"id": request_id, "object": "text_completion",
                                 "created": created, "model": model,
                                 "choices": [{"index": idx, "text": text,
                                              "logprobs": logprobs,
                                              "finish_reason": c.finish_reason,
                                              "stop_reason": c.stop_reason}]}
                        if stream_usage.continuous:
                            chunk["usage"] = streamed.choice_usage(i, idx, self.details)
                        yield sse(chunk)
                if stream_usage.final:
                    yield sse({"id": request_id, "object": "text_completion", "created": created,
                               "model": model, "choices": [],
                               "usage": streamed.usage(self.details).model_dump()})
            except Exception as e:  # the engine failed it, or died: say so, then end cleanly
                yield sse_error(e)
            yield sse("[DONE]")
        finally:
            ticket.release()
