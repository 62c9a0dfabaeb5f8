"""POST /v1/responses: OpenAI's Responses API as a thin translation onto the chat path
(responses_protocol.py → serving_chat.py's start), answered as a `response` object: output
items (a message with one output_text part, then one function_call per call), status
completed or incomplete (max_output_tokens), usage. Streamed, the typed events the openai
client parses, each with its sequence number: response.created, response.in_progress, per
item response.output_item.added, for the message response.content_part.added,
response.output_text.delta ... .done, response.content_part.done, for a call
response.function_call_arguments.delta / .done (its whole arguments when the choice
finishes), response.output_item.done, then response.completed. Errors are OpenAI's (the
routes' handlers); one after the stream began is an `error` event.
"""

from __future__ import annotations

import itertools
import json
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from tokenmill.outputs import CompletionOutput, RequestOutput
from tokenmill.server.protocol import UsageInfo
from tokenmill.server.protocol_chat import ChatCompletionRequest
from tokenmill.server.responses_protocol import ResponsesRequest
from tokenmill.server.serving_chat import OpenAIServingChat, answer
from tokenmill.server.serving_common import (
    ChoiceSoFar,
    StreamedChoices,
    check_failed,
    error_body,
    merge,
    usage,
)
from tokenmill.server.tools import ToolPlan


def _usage(used: UsageInfo) -> dict[str, Any]:
    """The Responses API's usage of a request's counts (`used`, with its cached tokens)."""
    cached = used.prompt_tokens_details.cached_tokens if used.prompt_tokens_details else 0
    return {"input_tokens": used.prompt_tokens, "input_tokens_details": {"cached_tokens": cached},
            "output_tokens": used.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": used.total_tokens}


def _message_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    return {"type": "message", "id": item_id, "status": status, "role": "assistant",
            "content": [] if status == "in_progress" else [_text_part(text)]}


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _call_item(call: dict[str, Any], arguments: str | None = None) -> dict[str, Any]:
    fn = call["function"]
    return {"type": "function_call", "id": f"fc_{call['id']}", "call_id": call["id"],
            "name": fn["name"], "arguments": fn["arguments"] if arguments is None
            else arguments, "status": "completed" if arguments is None else "in_progress"}


class OpenAIServingResponses:
    def __init__(self, chat: OpenAIServingChat) -> None:
        self.chat = chat

    def _skeleton(self, req: ResponsesRequest, lora: Any) -> dict[str, Any]:
        """The response object's fields that do not depend on the answer."""
        return {"id": self.chat.response_id("resp"), "object": "response",
                "created_at": int(time.time()), "model": self.chat.served_name(lora),
                "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
                "temperature": req.temperature, "top_p": req.top_p,
                "parallel_tool_calls": req.parallel_tool_calls is not False,
                "tool_choice": req.tool_choice or "auto", "tools": req.tools or [],
                "text": req.text or {"format": {"type": "text"}}, "store": False,
                "previous_response_id": None, "error": None, "incomplete_details": None}

    async def create(self, req: ResponsesRequest, raw: Request, lora: Any) -> Response:
        chat_req = ChatCompletionRequest.model_validate(req.to_chat_request())
        skeleton = self._skeleton(req, lora)
        done = await self.chat.run(chat_req, raw, lora, lambda s, ticket: self._stream(
            skeleton, s.gen, s.plan, ticket))
        if isinstance(done, StreamingResponse):
            return done
        final = done.final
        return JSONResponse(self._finished(skeleton, done.plan, final.outputs[0],
                                           usage([final], details=True)))

    def _finished(self, skeleton: dict[str, Any], plan: ToolPlan,
                  c: CompletionOutput | ChoiceSoFar, used: UsageInfo) -> dict[str, Any]:
        """The response object of an answer: its text and finish, and the usage counts."""
        message, _ = answer(plan, c)
        output = ([_message_item(f"msg_{skeleton['id']}", message["content"])]
                  if message["content"] else [])
        output += [_call_item(call) for call in message.get("tool_calls", [])]
        return skeleton | {"output": output, **_status(c),
                           "usage": _usage(used)}

    async def _stream(self, skeleton: dict[str, Any], gen: AsyncIterator[RequestOutput],
                      plan: ToolPlan, ticket: Any) -> AsyncIterator[str]:
        seq = itertools.count()

        def event(kind: str, **payload: Any) -> str:
            body = {"type": kind, "sequence_number": next(seq), **payload}
            return f"event: {kind}\ndata: {json.dumps(body, ensure_ascii=False)}\n\n"

        try:
            started = skeleton | {"status": "in_progress", "output": [], "usage": None}
            yield event("response.created", response=started)
            yield event("response.in_progress", response=started)
            msg_id, text, index, shown = f"msg_{skeleton['id']}", "", 0, {}
            streamed, c = StreamedChoices(), ChoiceSoFar(0)
            async for _, out in merge([gen]):
                check_failed([out])
                if not out.outputs:  # (DELTA: nothing new)
                    continue
                c = streamed.add(0, 0, out, out.outputs[0])
                delta, finish = OpenAIServingChat.delta(plan, c, shown)
                if delta.get("content"):
                    if not text:
                        yield event("response.output_item.added", output_index=index,
                                    item=_message_item(msg_id, "", "in_progress"))
                        yield event("response.content_part.added", item_id=msg_id,
                                    output_index=index, content_index=0, part=_text_part(""))
                    text += delta["content"]
                    yield event("response.output_text.delta", item_id=msg_id,
                                output_index=index, content_index=0, delta=delta["content"],
                                logprobs=[])
                if finish is None:
                    continue
                for e in self._finish_events(event, msg_id, text, index, delta):
                    yield e
            yield event("response.completed", response=self._finished(
                skeleton, plan, c, streamed.usage(details=True)))
        except Exception as e:  # the engine failed it, or died, after it began
            yield event("error", **error_body(400 if isinstance(e, ValueError) else 500,
                                              str(e))["error"])
        finally:
            ticket.release()

    @staticmethod
    def _finish_events(event: Any, msg_id: str, text: str, index: int,
                       delta: dict[str, Any]) -> list[str]:
        """The message item's closing events, then each call's item."""
        out = []
        if text:
            out += [event("response.output_text.done", item_id=msg_id, output_index=index,
                          content_index=0, text=text, logprobs=[]),
                    event("response.content_part.done", item_id=msg_id, output_index=index,
                          content_index=0, part=_text_part(text)),
                    event("response.output_item.done", output_index=index,
                          item=_message_item(msg_id, text))]
            index += 1
        for call in delta.get("tool_calls", []):
            item, args = _call_item(call), call["function"]["arguments"]
            out += [event("response.output_item.added", output_index=index,
                          item=_call_item(call, "")),
                    event("response.function_call_arguments.delta", item_id=item["id"],
                          output_index=index, delta=args),
                    event("response.function_call_arguments.done", item_id=item["id"],
                          output_index=index, arguments=args, name=item["name"]),
                    event("response.output_item.done", output_index=index, item=item)]
            index += 1
        return out


def _status(c: CompletionOutput | ChoiceSoFar) -> dict[str, Any]:
    if c.finish_reason == "length":
        return {"status": "incomplete", "incomplete_details": {"reason": "max_output_tokens"}}
    return {"status": "completed"}
