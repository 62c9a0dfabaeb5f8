"""POST /v1/completions: one or several prompts (text or token ids), n samples each, streamed
as Server-Sent Events or returned whole. Choice index = prompt index * n + sample index.

A stream always ends with [DONE]: after each choice's finish_reason ("abort" for a deadline or a
shutdown), or after an error event if the engine failed the request."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from tokenmill.lora.request import LoRARequest
from tokenmill.outputs import CompletionOutput, RequestOutput
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
    usage,
)


def completion_logprobs(c: CompletionOutput, text_offset: int = 0
                        ) -> tuple[dict[str, Any] | None, int]:
    """OpenAI's legacy completions logprobs for the output's tokens (a stream's: its new ones),
    their text offsets counted from `text_offset` (the decoded tokens' lengths); and the
    offset after them, where a stream's next tokens start."""
    if c.logprobs is None:
        return None, text_offset
    tokens, token_lps, tops, offsets = [], [], [], []
    offset = text_offset
    for tid, entry in zip(c.token_ids, c.logprobs, strict=True):
        chosen = entry[tid]
        tokens.append(chosen.decoded_token)
        token_lps.append(chosen.logprob)
        tops.append({lp.decoded_token: lp.logprob for lp in entry.values()})
        offsets.append(offset)
        offset += len(chosen.decoded_token or "")
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops,
            "text_offset": offsets}, offset


class OpenAIServingCompletion(OpenAIServing):
    async def create(self, req: CompletionRequest, raw: Request,
                     lora: LoRARequest | None = None) -> Any:
        if req.suffix:
            raise ValueError("suffix is not supported by tokenmill yet")
        if req.echo:
            raise ValueError("echo is not supported by tokenmill yet")
        params = req.to_sampling_params(self.sampling_defaults)
        prompts = req.prompts()
        ticket = self.admit(len(prompts), params)
        try:
            request_id = self.response_id("cmpl")
            gens = await self.add_all(prompts, params, req.timeout, lora, req.priority)
            if req.stream:
                return StreamingResponse(self._stream(request_id, gens, params.n,
                                                      StreamUsage.of(req.stream_options),
                                                      ticket, self.served_name(lora)),
                                         media_type="text/event-stream")
            finals = await collect(gens, raw)
        except BaseException:
            ticket.release()
            raise
        ticket.release()
        check_failed(finals)
        choices = []
        for i, out in enumerate(finals):
            for c in out.outputs:
                choice = {"index": i * params.n + c.index, "text": c.text,
                          "logprobs": completion_logprobs(c)[0],
                          "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
                if out.prompt_logprobs is not None:
                    choice["prompt_logprobs"] = prompt_logprobs_json(out)
                choices.append(choice)
        return JSONResponse({"id": request_id, "object": "text_completion",
                             "created": int(time.time()), "model": self.served_name(lora),
                             "choices": choices, "usage": usage(finals).model_dump()})

    async def _stream(self, request_id: str, gens: list[AsyncIterator[RequestOutput]], n: int,
                      stream_usage: StreamUsage, ticket: Ticket, model: str) -> AsyncIterator[str]:
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
                        logprobs, offsets[idx] = completion_logprobs(c, offsets.get(idx, 0))
                        chunk = {"id": request_id, "object": "text_completion",
                                 "created": created, "model": model,
                                 "choices": [{"index": idx, "text": c.text,
                                              "logprobs": logprobs,
                                              "finish_reason": c.finish_reason,
                                              "stop_reason": c.stop_reason}]}
                        if stream_usage.continuous:
                            chunk["usage"] = streamed.choice_usage(i, idx)
                        yield sse(chunk)
                if stream_usage.final:
                    yield sse({"id": request_id, "object": "text_completion", "created": created,
                               "model": model, "choices": [],
                               "usage": streamed.usage().model_dump()})
            except Exception as e:  # the engine failed it, or died: say so, then end cleanly
                yield sse_error(e)
            yield sse("[DONE]")
        finally:
            ticket.release()
