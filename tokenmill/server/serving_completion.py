"""POST /v1/completions: one or several prompts (text or token ids), n samples each, streamed
as Server-Sent Events or returned whole. Choice index = prompt index * n + sample index."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from tokenmill.engine.async_engine import AsyncLLM
from tokenmill.outputs import CompletionOutput, RequestOutput
from tokenmill.server.protocol import CompletionRequest, random_id
from tokenmill.server.serving_common import DeltaTracker, add_all, collect, merge, sse, usage


def _prompts(prompt: str | list[str] | list[int] | list[list[int]]) -> list[Any]:
    if isinstance(prompt, str):
        return [prompt]
    if prompt and all(isinstance(t, int) for t in prompt):
        return [prompt]
    return list(prompt)


def completion_logprobs(c: CompletionOutput, start: int = 0,
                        text_offset: int = 0) -> dict[str, Any] | None:
    """OpenAI's legacy completions logprobs for tokens [start:] of a completion."""
    if c.logprobs is None:
        return None
    tokens, token_lps, tops, offsets = [], [], [], []
    offset = text_offset
    for tid, entry in zip(c.token_ids[start:], c.logprobs[start:], strict=True):
        chosen = entry[tid]
        tokens.append(chosen.decoded_token)
        token_lps.append(chosen.logprob)
        tops.append({lp.decoded_token: lp.logprob for lp in entry.values()})
        offsets.append(offset)
        offset += len(chosen.decoded_token or "")
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops,
            "text_offset": offsets}


class OpenAIServingCompletion:
    def __init__(self, engine: AsyncLLM, model_name: str) -> None:
        self.engine, self.model_name = engine, model_name

    async def create(self, req: CompletionRequest, raw: Request) -> Any:
        if req.suffix:
            raise ValueError("suffix is not supported")
        if req.echo:
            raise ValueError("echo is not supported")
        params = req.to_sampling_params()
        request_id = random_id("cmpl")
        gens = await add_all(self.engine, request_id, _prompts(req.prompt), params)
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return StreamingResponse(self._stream(request_id, gens, params.n, include_usage),
                                     media_type="text/event-stream")
        finals = await collect(gens, raw)
        choices = []
        for i, out in enumerate(finals):
            for c in out.outputs:
                choices.append({"index": i * params.n + c.index, "text": c.text,
                                "logprobs": completion_logprobs(c),
                                "finish_reason": c.finish_reason, "stop_reason": c.stop_reason})
        return JSONResponse({"id": request_id, "object": "text_completion",
                             "created": int(time.time()), "model": self.model_name,
                             "choices": choices, "usage": usage(finals).model_dump()})

    async def _stream(self, request_id: str, gens: list[AsyncIterator[RequestOutput]], n: int,
                      include_usage: bool) -> AsyncIterator[str]:
        created = int(time.time())
        sent = DeltaTracker()
        finals: dict[int, RequestOutput] = {}
        async for i, out in merge(gens):
            finals[i] = out
            for c in out.outputs:
                idx = i * n + c.index
                if (before := sent.advance(idx, c)) is None:
                    continue
                t0, k0 = before
                yield sse({"id": request_id, "object": "text_completion", "created": created,
                           "model": self.model_name,
                           "choices": [{"index": idx, "text": c.text[t0:],
                                        "logprobs": completion_logprobs(c, k0, t0),
                                        "finish_reason": c.finish_reason,
                                        "stop_reason": c.stop_reason}]})
        if include_usage:
            yield sse({"id": request_id, "object": "text_completion", "created": created,
                       "model": self.model_name, "choices": [],
                       "usage": usage([finals[i] for i in sorted(finals)]).model_dump()})
        yield sse("[DONE]")
