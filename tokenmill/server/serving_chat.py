"""POST /v1/chat/completions: messages rendered with the model's chat template (on a worker
thread: a template over a large conversation must not hold up the event loop), n samples,
streamed as `chat.completion.chunk` events (a role delta first, then content deltas, then the
finish reason; an error event if the engine failed the request; always [DONE] last) or
returned whole."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.outputs import CompletionOutput, RequestOutput
from tokenmill.server.admission import Ticket
from tokenmill.server.protocol import ChatCompletionRequest, ChatMessage
from tokenmill.server.serving_common import (
    DeltaTracker,
    OpenAIServing,
    check_failed,
    collect,
    merge,
    prompt_logprobs_json,
    sse,
    sse_error,
    usage,
)


def render_chat(engine: LLMEngine, messages: list[ChatMessage], add_generation_prompt: bool = True,
                chat_template_kwargs: dict[str, Any] | None = None) -> dict[str, Any]:
    """The prompt dict (text and token ids) for a conversation; ValueError if unusable."""
    tokenizer = engine.tokenizer
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("this model has no chat template; use /v1/completions")
    if not messages:
        raise ValueError("messages must not be empty")
    conversation = [m.for_template() for m in messages]
    engine.check_text_length(sum(len(m["content"] or "") for m in conversation))
    try:
        text = tokenizer.apply_chat_template(conversation, tokenize=False,
                                             add_generation_prompt=add_generation_prompt,
                                             **(chat_template_kwargs or {}))
    except Exception as e:  # jinja errors for malformed conversations
        raise ValueError(f"messages cannot be rendered with the chat template: {e}") from e
    return {"prompt": text, "prompt_token_ids": tokenizer.encode(text, add_special_tokens=False)}


def chat_logprobs(c: CompletionOutput, top_k: int, start: int = 0) -> dict[str, Any] | None:
    """OpenAI chat logprobs for tokens [start:]: the chosen token and the top_k alternatives
    (the entries ranked 1..top_k; the chosen token is among them only if it ranks there)."""
    if c.logprobs is None:
        return None
    content = []
    for tid, entry in zip(c.token_ids[start:], c.logprobs[start:], strict=True):
        chosen = entry[tid]
        top = sorted((lp for lp in entry.values() if lp.rank <= top_k), key=lambda lp: lp.rank)
        content.append({"token": chosen.decoded_token, "logprob": chosen.logprob,
                        "bytes": list((chosen.decoded_token or "").encode()),
                        "top_logprobs": [{"token": lp.decoded_token, "logprob": lp.logprob,
                                          "bytes": list((lp.decoded_token or "").encode())}
                                         for lp in top]})
    return {"content": content}


class OpenAIServingChat(OpenAIServing):
    async def create(self, req: ChatCompletionRequest, raw: Request) -> Any:
        params = req.to_sampling_params()
        ticket = self.admit(1, params)
        try:
            prompt = await asyncio.get_running_loop().run_in_executor(
                None, render_chat, self.engine.engine, req.messages, req.add_generation_prompt,
                req.chat_template_kwargs)
            request_id = self.response_id("chatcmpl")
            (gen,) = await self.add_all([prompt], params, req.timeout)
            if req.stream:
                include_usage = bool(req.stream_options and req.stream_options.include_usage)
                return StreamingResponse(self._stream(request_id, gen, params.n,
                                                      params.logprobs or 0, include_usage,
                                                      ticket), media_type="text/event-stream")
            (final,) = await collect([gen], raw)
        except BaseException:
            ticket.release()
            raise
        ticket.release()
        check_failed([final])
        choices = [{"index": c.index, "message": {"role": "assistant", "content": c.text},
                    "logprobs": chat_logprobs(c, params.logprobs or 0),
                    "finish_reason": c.finish_reason,
                    "stop_reason": c.stop_reason} for c in final.outputs]
        body = {"id": request_id, "object": "chat.completion", "created": int(time.time()),
                "model": self.model_name, "choices": choices,
                "usage": usage([final]).model_dump()}
        if final.prompt_logprobs is not None:
            body["prompt_logprobs"] = prompt_logprobs_json(final)
        return JSONResponse(body)

    async def _stream(self, request_id: str, gen: AsyncIterator[RequestOutput], n: int,
                      top_k: int, include_usage: bool, ticket: Ticket) -> AsyncIterator[str]:
        created = int(time.time())

        def chunk(choices: list[dict[str, Any]], **extra: Any) -> str:
            return sse({"id": request_id, "object": "chat.completion.chunk", "created": created,
                        "model": self.model_name, "choices": choices, **extra})

        try:  # the ticket is released however the stream ends
            try:
                yield chunk([{"index": i, "delta": {"role": "assistant", "content": ""},
                              "logprobs": None, "finish_reason": None} for i in range(n)])
                sent = DeltaTracker()
                final = None
                async for _, out in merge([gen]):
                    check_failed([out])
                    final = out
                    for c in out.outputs:
                        if (before := sent.advance(c.index, c)) is None:
                            continue
                        t0, k0 = before
                        delta = {"content": c.text[t0:]} if len(c.text) > t0 else {}
                        yield chunk([{"index": c.index, "delta": delta,
                                      "logprobs": chat_logprobs(c, top_k, k0),
                                      "finish_reason": c.finish_reason,
                                      "stop_reason": c.stop_reason}])
                if include_usage and final is not None:
                    yield chunk([], usage=usage([final]).model_dump())
            except Exception as e:  # the engine failed it, or died: say so, then end cleanly
                yield sse_error(e)
            yield sse("[DONE]")
        finally:
            ticket.release()
