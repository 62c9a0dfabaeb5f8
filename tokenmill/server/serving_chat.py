"""POST /v1/chat/completions: messages rendered with the model's chat template
(server/chat_rendering.py, on a worker thread: a template over a large conversation must not
hold up the event loop), n samples,
streamed as `chat.completion.chunk` events (a role delta first, then content deltas, then the
finish reason; an error event if the engine failed the request; always [DONE] last) or
returned whole.

With tools (server/tools.py), text that is or may become a tool call is held back while
streaming; when a choice finishes, its calls go out as one `tool_calls` delta each (id, name
and the whole arguments), after any content still unsent, and its finish_reason is
"tool_calls". Streamed and whole answers carry the same content and calls.

With --reasoning-parser the answer's reasoning is split off (`message.reasoning`, streamed
as `delta.reasoning`); the Responses and Messages APIs run here too and split it the same way
(AnswerShape). Where the tags an answer is split at (the tool parser's markers, the reasoning
tags) are special tokens, the request keeps its special tokens in its text (keep_markers).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from tokenmill.lora.request import LoRARequest
from tokenmill.outputs import CompletionOutput, Logprob, RequestOutput
from tokenmill.reasoning.parsers import (
    ReasoningParser,
    get_reasoning_parser,
)
from tokenmill.sampling_params import SamplingParams
from tokenmill.server.admission import Ticket
from tokenmill.server.chat_rendering import Rendering, render_chat, skipped_on_decode
from tokenmill.server.protocol import CompletionTokensDetails, UsageInfo
from tokenmill.server.protocol_chat import ChatCompletionRequest
from tokenmill.server.serving_common import (
    ChoiceSoFar,
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
from tokenmill.server.tools import (
    ToolOptions,
    ToolPlan,
    plan_tools,
)


@dataclasses.dataclass
class Started:
    """A queued conversation: its tool plan, prompt, parameters and output stream."""

    plan: ToolPlan
    prompt: dict[str, Any]
    params: SamplingParams
    gen: AsyncIterator[RequestOutput]


@dataclasses.dataclass
class Finished:
    """A conversation's final output (not streamed), checked."""

    plan: ToolPlan
    params: SamplingParams
    final: RequestOutput


Streamer = Callable[[Started, Ticket], AsyncIterator[str]]


def chat_logprobs(c: CompletionOutput, top_k: int, as_ids: bool = False
                  ) -> dict[str, Any] | None:
    """OpenAI chat logprobs for the output's tokens (a stream's: its new ones): the chosen
    token and the top_k alternatives (the entries ranked 1..top_k; the chosen token is among
    them only if it ranks there); as_ids: tokens named "token_id:N" (vLLM's)."""
    if c.logprobs is None:
        return None

    def item(tid: int, lp: Logprob) -> dict[str, Any]:
        token = token_name(tid, lp.decoded_token, as_ids) or ""
        return {"token": token, "logprob": lp.logprob, "bytes": list(token.encode())}

    content = []
    for tid, entry in zip(c.token_ids, c.logprobs, strict=True):
        top = sorted((t for t in entry.items() if t[1].rank <= top_k), key=lambda t: t[1].rank)
        content.append(item(tid, entry[tid]) | {"top_logprobs": [item(*t) for t in top]})
    return {"content": content}


def with_tool_constraint(params: SamplingParams, plan: ToolPlan) -> SamplingParams:
    """The request's parameters, constrained to the plan's tool-call format if it has one."""
    if plan.constraint is None:
        return params
    if params.structured_outputs is not None:
        raise ValueError(f'tool_choice "{plan.mode}" constrains the answer to tool calls and '
                         "cannot be combined with response_format or structured_outputs")
    return dataclasses.replace(params, structured_outputs=plan.constraint)


def answer(plan: ToolPlan, c: CompletionOutput | ChoiceSoFar
           ) -> tuple[dict[str, Any], str | None]:
    """A choice's assistant message (content and tool calls) and finish reason (from its text
    and finish: a whole answer's output, or a stream's choice so far)."""
    content, calls = plan.calls(c.text)
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = [call.to_openai() for call in calls]
    finish = "tool_calls" if calls and c.finish_reason == "stop" else c.finish_reason
    return message, finish


@dataclasses.dataclass(frozen=True)
class AnswerShape:
    """How a chat request's answer is written: the message's role (--response-role), the
    logprobs' token names, and its reasoning split off (--reasoning-parser; shown unless the
    request's include_reasoning is false)."""

    role: str = "assistant"
    as_ids: bool = False
    reasoning: ReasoningParser | None = None
    include_reasoning: bool = True

    def split(self, c: Any, finished: bool, opened: bool) -> tuple[Any, str | None]:
        """The choice as its content alone (for the message and tool calls), and its
        reasoning (None: no parser, none, or not asked); `opened`: its rendered prompt ends
        inside <think> (`opens_thinking`)."""
        if self.reasoning is None:
            return c, None
        reasoning, content = self.reasoning.split(c.text, finished, opened)
        return (dataclasses.replace(c, text=content),
                reasoning if self.include_reasoning else None)

    def opens_thinking(self, prompt: str | None) -> bool:
        """Whether the answer to `prompt` begins in reasoning (read once a request, and only
        with a parser)."""
        return self.reasoning is not None and self.reasoning.prompt_opens(prompt or "")


async def one_choice_deltas(started: Started, shape: AnswerShape, shown: dict[int, int],
                            streamed: StreamedChoices
                            ) -> AsyncIterator[tuple[ChoiceSoFar, str, dict[str, Any],
                                                     str | None]]:
    """A one-choice stream (the Responses and Messages APIs) output by output: the choice so
    far (added to `streamed`), its reasoning so far, its content delta (OpenAIServingChat.
    delta, `shown` its record) and its finish reason."""
    opened = shape.opens_thinking(started.prompt["prompt"])
    async for _, out in merge([started.gen]):
        check_failed([out])
        if not out.outputs:  # (DELTA: nothing new)
            continue
        c = streamed.add(0, 0, out, out.outputs[0])
        content, reasoning = shape.split(c, c.finish_reason is not None, opened)
        delta, finish = OpenAIServingChat.delta(started.plan, content, shown)
        yield c, reasoning or "", delta, finish


class OpenAIServingChat(OpenAIServing):
    def __init__(self, *args: Any, tool_options: ToolOptions | None = None) -> None:
        super().__init__(*args)
        self.tool_options = tool_options or ToolOptions()
        reasoning = self.engine.engine.config.reasoning  # --reasoning-parser
        self.reasoning = (None if reasoning is None or reasoning.parser is None
                          else get_reasoning_parser(reasoning.parser))

    def shape(self, req: ChatCompletionRequest) -> AnswerShape:
        # vLLM's: --response-role answers a generation prompt, else the last message's role
        role = (req.messages[-1].role if req.messages and not req.add_generation_prompt
                else self.options.response_role)  # (no messages: a 400 when rendered)
        return AnswerShape(role, self.as_ids(req), self.reasoning, req.include_reasoning)

    def with_reasoning_tokens(self, used: UsageInfo, prompt: list[int],
                              answers: list[list[int]]) -> UsageInfo:
        """`used` with vLLM's completion_tokens_details.reasoning_tokens (with a reasoning
        parser: the answers' tokens through the end of their reasoning)."""
        tokens = self.engine.engine.intake.reasoning
        if self.reasoning is not None and tokens is not None:
            used.completion_tokens_details = CompletionTokensDetails(
                reasoning_tokens=sum(tokens.count(prompt, a) for a in answers))
        return used

    def keep_markers(self, params: SamplingParams, plan: ToolPlan) -> SamplingParams:
        """The request detokenized with its special tokens where the tags its answer is split
        at (the tool parser's markers, the reasoning tags) are special tokens, which
        skip_special_tokens would drop (as vLLM's Mistral parsers ask)."""
        tags = list(plan.parser.markers) if plan.mode == "auto" else []
        if self.reasoning is not None:
            tags += [self.reasoning.start, self.reasoning.end]
        tokenizer = self.engine.engine.tokenizer
        if params.skip_special_tokens and any(skipped_on_decode(tokenizer, t) for t in tags):
            return dataclasses.replace(params, skip_special_tokens=False)
        return params

    def prepare(self, req: ChatCompletionRequest) -> tuple[ToolPlan, dict[str, Any]]:
        """(tool plan, prompt): on a worker thread (tool schemas compile, templates render)."""
        engine = self.engine.engine
        plan = plan_tools(req.tools, req.tool_choice, req.parallel_tool_calls,
                          self.tool_options, engine.structured.compile)
        if req.chat_template is not None and not self.options.trust_request_chat_template:
            raise ValueError("chat_template is only allowed in a request when the server runs "
                             "with --trust-request-chat-template")
        prompt = render_chat(engine, req.messages, Rendering.of(req), plan.tools)
        return plan, prompt

    async def run(self, req: ChatCompletionRequest, raw: Request, lora: LoRARequest | None,
                  streamer: Streamer) -> StreamingResponse | Finished:
        """Render and queue one conversation (the tool plan, its call format as a grammar),
        then stream it (`streamer`, which owns the admission ticket) or wait for it. The chat,
        Responses and Messages APIs all run here."""
        params = req.to_sampling_params(self.sampling_defaults)
        ticket = self.admit(1, params)
        try:
            plan, prompt = await asyncio.get_running_loop().run_in_executor(
                None, self.prepare, req)
            params = self.keep_markers(with_tool_constraint(params, plan), plan)
            (gen,) = await self.add_all([prompt], params, req.timeout, lora, req.priority)
            if req.stream:
                return StreamingResponse(streamer(Started(plan, prompt, params, gen), ticket),
                                         media_type="text/event-stream")
            (final,) = await collect([gen], raw)
        except BaseException:
            ticket.release()
            raise
        ticket.release()
        check_failed([final])
        return Finished(plan, params, final)

    async def create(self, req: ChatCompletionRequest, raw: Request,
                     lora: LoRARequest | None = None) -> Any:
        request_id = self.response_id("chatcmpl")
        stream_usage, shape = self.stream_usage(req.stream_options), self.shape(req)
        done = await self.run(req, raw, lora, lambda s, ticket: self._stream(
            request_id, s, stream_usage, ticket, self.served_name(lora), shape))
        if isinstance(done, StreamingResponse):
            return done
        plan, params, final = done.plan, done.params, done.final
        choices = []
        opened = shape.opens_thinking(final.prompt)
        for c in final.outputs:
            content, reasoning = shape.split(c, True, opened)
            message, finish = answer(plan, content)
            message["role"] = shape.role
            if reasoning is not None:
                message["reasoning"] = reasoning
            choices.append({"index": c.index, "message": message,
                            "logprobs": chat_logprobs(c, params.logprobs or 0, shape.as_ids),
                            "finish_reason": finish, "stop_reason": c.stop_reason})
        body = {"id": request_id, "object": "chat.completion", "created": int(time.time()),
                "model": self.served_name(lora), "choices": choices,
                "usage": self.with_reasoning_tokens(
                    usage([final], self.details), final.prompt_token_ids,
                    [c.token_ids for c in final.outputs]).model_dump()}
        if final.prompt_logprobs is not None:
            body["prompt_logprobs"] = prompt_logprobs_json(final)
        return JSONResponse(body)

    async def _stream(self, request_id: str, started: Started, stream_usage: StreamUsage,
                      ticket: Ticket, model: str, shape: AnswerShape) -> AsyncIterator[str]:
        created = int(time.time())
        plan, n, top_k = started.plan, started.params.n, started.params.logprobs or 0
        n_prompt = len(started.prompt["prompt_token_ids"])

        def chunk(choices: list[dict[str, Any]], usage: dict[str, int] | None = None) -> str:
            body = {"id": request_id, "object": "chat.completion.chunk", "created": created,
                    "model": model, "choices": choices}
            return sse(body if usage is None else body | {"usage": usage})

        try:  # the ticket is released however the stream ends
            try:
                first = [{"index": i, "delta": {"role": shape.role, "content": ""},
                          "logprobs": None, "finish_reason": None} for i in range(n)]
                yield chunk(first, UsageInfo(prompt_tokens=n_prompt, completion_tokens=0,
                                            total_tokens=n_prompt).model_dump()
                            if stream_usage.continuous else None)
                streamed = StreamedChoices()
                shown: dict[int, int] = {}  # choice index → content characters sent
                thought: dict[int, int] = {}  # choice index → reasoning characters sent
                opened = shape.opens_thinking(started.prompt["prompt"])
                async for _, out in merge([started.gen]):
                    check_failed([out])
                    for new in out.outputs:  # (DELTA: the new text, tokens and logprobs)
                        c = streamed.add(0, new.index, out, new)
                        content, reasoning = shape.split(c, c.finish_reason is not None,
                                                         opened)
                        delta, finish = self.delta(plan, content, shown)
                        if reasoning and len(reasoning) > thought.get(c.index, 0):
                            delta["reasoning"] = reasoning[thought.get(c.index, 0):]
                            thought[c.index] = len(reasoning)
                        yield chunk([{"index": c.index, "delta": delta,
                                      "logprobs": chat_logprobs(new, top_k, shape.as_ids),
                                      "finish_reason": finish, "stop_reason": c.stop_reason}],
                                    streamed.choice_usage(0, c.index, self.details)
                                    if stream_usage.continuous else None)
                if stream_usage.final and streamed.choices:
                    yield chunk([], self.with_reasoning_tokens(
                        streamed.usage(self.details), started.prompt["prompt_token_ids"],
                        [c.token_ids for c in streamed.choices.values()]).model_dump())
            except Exception as e:  # the engine failed it, or died: say so, then end cleanly
                yield sse_error(e)
            yield sse("[DONE]")
        finally:
            ticket.release()

    @staticmethod
    def delta(plan: ToolPlan, c: ChoiceSoFar, shown: dict[int, int]
              ) -> tuple[dict[str, Any], str | None]:
        """The delta of a streamed choice's new output (content not yet sent and safe to send;
        at its finish, the rest and its tool calls) and its finish reason."""
        sent = shown.get(c.index, 0)
        if c.finish_reason is None:
            hold = (None if plan.mode == "none" else
                    plan.parser.call_start(c.text) if plan.mode == "auto" else 0)
            visible = c.text if hold is None else c.text[:hold]
            shown[c.index] = max(sent, len(visible))
            return ({"content": visible[sent:]} if len(visible) > sent else {}), None
        message, finish = answer(plan, c)
        content = message["content"] or ""
        delta: dict[str, Any] = {"content": content[sent:]} if len(content) > sent else {}
        if "tool_calls" in message:
            delta["tool_calls"] = [dict(call, index=i)
                                   for i, call in enumerate(message["tool_calls"])]
        shown[c.index] = len(content)
        return delta, finish
