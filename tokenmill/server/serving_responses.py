"""POST /v1/responses: OpenAI's Responses API as a thin translation onto the chat path
(responses_protocol.py → serving_chat.py's start), answered as a `response` object: output
items (with --reasoning-parser, a reasoning item whose content is the reasoning text; a
message with one output_text part; then one function_call per call), status completed or
incomplete (max_output_tokens), usage (output_tokens_details.reasoning_tokens: the answer's
tokens up to the end of its reasoning). Streamed, the typed events the openai client
parses, each with its sequence number: response.created, response.in_progress, per item
response.output_item.added, for the reasoning response.reasoning_text.delta ... .done, for
the message response.content_part.added, response.output_text.delta ... .done,
response.content_part.done, for a call response.function_call_arguments.delta / .done (its
whole arguments when the choice finishes), response.output_item.done, then
response.completed. Errors are OpenAI's (the routes' handlers); one after the stream began
is an `error` event.
"""

from __future__ import annotations

import itertools
import json
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from tokenmill.outputs import CompletionOutput
from tokenmill.server.protocol import UsageInfo
from tokenmill.server.protocol_chat import ChatCompletionRequest
from tokenmill.server.responses_protocol import ResponsesRequest
from tokenmill.server.serving_chat import (
    AnswerShape,
    OpenAIServingChat,
    Started,
    answer,
    one_choice_deltas,
)
from tokenmill.server.serving_common import (
    ChoiceSoFar,
    StreamedChoices,
    error_body,
    usage,
)
from tokenmill.server.tools import ToolPlan


def _usage(used: UsageInfo) -> dict[str, Any]:
    """The Responses API's usage of a request's counts (`used`, with its cached and
    reasoning tokens)."""
    cached = used.prompt_tokens_details.cached_tokens if used.prompt_tokens_details else 0
    details = used.completion_tokens_details
    return {"input_tokens": used.prompt_tokens, "input_tokens_details": {"cached_tokens": cached},
            "output_tokens": used.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": details.reasoning_tokens
                                      if details else 0},
            "total_tokens": used.total_tokens}


def _reasoning_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    return {"type": "reasoning", "id": item_id, "summary": [], "status": status,
            "content": [] if status == "in_progress" else [{"type": "reasoning_text",
                                                              "text": text}],
            "encrypted_content": None}


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
                "reasoning": None if req.reasoning is None else {
                    "effort": req.reasoning.effort, "summary": None},
                "previous_response_id": None, "error": None,
                "incomplete_details": None}

    async def create(self, req: ResponsesRequest, raw: Request, lora: Any) -> Response:
        chat_req = ChatCompletionRequest.model_validate(req.to_chat_request())
        skeleton, shape = self._skeleton(req, lora), self.chat.shape(chat_req)
        done = await self.chat.run(chat_req, raw, lora, lambda s, ticket: self._stream(
            skeleton, s, shape, ticket))
        if isinstance(done, StreamingResponse):
            return done
        final = done.final
        return JSONResponse(self._finished(
            skeleton, done.plan, shape, final.prompt, final.outputs[0],
            self.chat.with_reasoning_tokens(usage([final], details=True),
                                            final.prompt_token_ids,
                                            [final.outputs[0].token_ids])))

    def _finished(self, skeleton: dict[str, Any], plan: ToolPlan, shape: AnswerShape,
                  prompt: str | None, c: CompletionOutput | ChoiceSoFar, used: UsageInfo
                  ) -> dict[str, Any]:
        """The response object of an answer: its reasoning, text and finish, and the usage
        counts."""
        content, reasoning = shape.split(c, True, shape.opens_thinking(prompt))
        message, _ = answer(plan, content)
        output = ([_reasoning_item(f"rs_{skeleton['id']}", reasoning)] if reasoning else [])
        output += ([_message_item(f"msg_{skeleton['id']}", message["content"])]
                   if message["content"] else [])
        output += [_call_item(call) for call in message.get("tool_calls", [])]
        return skeleton | {"output": output, **_status(c), "usage": _usage(used)}

    async def _stream(self, skeleton: dict[str, Any], started: Started, shape: AnswerShape,
                      ticket: Any) -> AsyncIterator[str]:
        items = _StreamedItems(skeleton["id"])
        try:
            begun = skeleton | {"status": "in_progress", "output": [], "usage": None}
            yield items.event("response.created", response=begun)
            yield items.event("response.in_progress", response=begun)
            streamed, c = StreamedChoices(), ChoiceSoFar(0)
            async for c, reasoning, delta, finish in one_choice_deltas(  # noqa: B007 (c: after)
                    started, shape, items.shown, streamed):
                for e in items.reasoning(reasoning):
                    yield e
                for e in items.text(delta.get("content", "")):
                    yield e
                if finish is not None:
                    for e in items.finish(delta.get("tool_calls", [])):
                        yield e
            done = self._finished(skeleton, started.plan, shape, started.prompt["prompt"], c,
                                  self.chat.with_reasoning_tokens(
                                      streamed.usage(details=True),
                                      started.prompt["prompt_token_ids"], [c.token_ids]))
            yield items.event("response.completed", response=done)
        except Exception as e:  # the engine failed it, or died, after it began
            yield items.event("error", **error_body(400 if isinstance(e, ValueError) else 500,
                                                    str(e))["error"])
        finally:
            ticket.release()


class _StreamedItems:
    """A streamed response's output items and their events, in order: the reasoning item
    (closed when the message begins), the message, then each call's item."""

    def __init__(self, response_id: str) -> None:
        self.seq = itertools.count()
        self.index = 0  # the output index of the item now open (or next)
        self.reasoning_id, self.msg_id = f"rs_{response_id}", f"msg_{response_id}"
        self.thought, self.said = "", ""
        self.thinking = False  # the reasoning item is open
        self.shown: dict[int, int] = {}  # the message's content characters sent (delta's)

    def event(self, kind: str, **payload: Any) -> str:
        body = {"type": kind, "sequence_number": next(self.seq), **payload}
        return f"event: {kind}\ndata: {json.dumps(body, ensure_ascii=False)}\n\n"

    def reasoning(self, reasoning: str) -> list[str]:
        """Events for the reasoning written since the last call."""
        new, out = reasoning[len(self.thought):], []
        if not new or self.said:
            return out
        if not self.thought:
            self.thinking = True
            out.append(self.event("response.output_item.added", output_index=self.index,
                                  item=_reasoning_item(self.reasoning_id, "", "in_progress")))
        self.thought = reasoning
        return out + [self.event("response.reasoning_text.delta", item_id=self.reasoning_id,
                                 output_index=self.index, content_index=0, delta=new)]

    def _close_reasoning(self) -> list[str]:
        if not self.thinking:
            return []
        self.thinking = False
        out = [self.event("response.reasoning_text.done", item_id=self.reasoning_id,
                          output_index=self.index, content_index=0, text=self.thought),
               self.event("response.output_item.done", output_index=self.index,
                          item=_reasoning_item(self.reasoning_id, self.thought))]
        self.index += 1
        return out

    def text(self, new: str) -> list[str]:
        """Events for the message's new text."""
        if not new:
            return []
        out = self._close_reasoning()
        if not self.said:
            out += [self.event("response.output_item.added", output_index=self.index,
                               item=_message_item(self.msg_id, "", "in_progress")),
                    self.event("response.content_part.added", item_id=self.msg_id,
                               output_index=self.index, content_index=0,
                               part=_text_part(""))]
        self.said += new
        return out + [self.event("response.output_text.delta", item_id=self.msg_id,
                                 output_index=self.index, content_index=0, delta=new,
                                 logprobs=[])]

    def finish(self, calls: list[dict[str, Any]]) -> list[str]:
        """The open items' closing events, then each call's item."""
        out = self._close_reasoning()
        if self.said:
            out += [self.event("response.output_text.done", item_id=self.msg_id,
                               output_index=self.index, content_index=0, text=self.said,
                               logprobs=[]),
                    self.event("response.content_part.done", item_id=self.msg_id,
                               output_index=self.index, content_index=0,
                               part=_text_part(self.said)),
                    self.event("response.output_item.done", output_index=self.index,
                               item=_message_item(self.msg_id, self.said))]
            self.index += 1
        for call in calls:
            item, args = _call_item(call), call["function"]["arguments"]
            out += [self.event("response.output_item.added", output_index=self.index,
                               item=_call_item(call, "")),
                    self.event("response.function_call_arguments.delta", item_id=item["id"],
                               output_index=self.index, delta=args),
                    self.event("response.function_call_arguments.done", item_id=item["id"],
                               output_index=self.index, arguments=args, name=item["name"]),
                    self.event("response.output_item.done", output_index=self.index,
                               item=item)]
            self.index += 1
        return out


def _status(c: CompletionOutput | ChoiceSoFar) -> dict[str, Any]:
    if c.finish_reason == "length":
        return {"status": "incomplete", "incomplete_details": {"reason": "max_output_tokens"}}
    return {"status": "completed"}
