"""OutputProcessor: turns each step's sampled tokens into user-facing RequestOutputs.

It owns, per sample: incremental detokenization, stop-string search, logprobs converted to
vLLM's dict form with decoded tokens; per user request: the n samples and prompt logprobs.
Stop strings are found here (they need text) and reported back so the engine can finish those
requests in the scheduler and free their blocks at once. Embedding requests' partial poolings
are added up here too (engine/pooled_outputs.py), into an EmbeddingRequestOutput when done.

While a sample with stop strings is running, its visible text holds back the last
(longest stop string - 1) characters, which could still turn out to begin a stop string. A
sample ended by a stop token (EOS, a stop_token_ids entry) keeps the token in its token ids
but not in its text, unless include_stop_str_in_output (vLLM's rule: with
skip_special_tokens false the text would otherwise end in "</s>" or the stop id's word).

What an output holds follows the request's `output_kind` (sampling_params.RequestOutputKind):
everything so far (CUMULATIVE), what is new since its last output (DELTA: each sample keeps how
much of its tokens, visible text and logprobs it has handed out), or nothing until it finishes
(FINAL_ONLY: no output is built for the steps in between, the offline `LLM`'s saving at a
thousand running requests).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from tokenmill.core.interface import ModelRunnerOutput, PositionLogprobs
from tokenmill.core.request import Request, RequestStatus
from tokenmill.engine.detokenizer import IncrementalDetokenizer
from tokenmill.engine.pooled_outputs import PooledState
from tokenmill.metrics.stats import RequestTimings
from tokenmill.outputs import (
    CompletionOutput,
    EmbeddingRequestOutput,
    Logprob,
    PositionLogprobDict,
    RequestOutput,
)
from tokenmill.sampling_params import RequestOutputKind, SamplingParams


@dataclass
class SampleState:
    parent: ParentState
    index: int
    params: SamplingParams
    detok: IncrementalDetokenizer
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[PositionLogprobDict] | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # DELTA outputs: how much has been handed out (tokens, visible characters, logprobs),
    # and whether the finish reason has
    sent_tokens: int = 0
    sent_text: int = 0
    sent_logprobs: int = 0
    sent_finish: bool = False

    def visible_text(self) -> str:
        text = self.detok.text
        if self.finish_reason is None and self.params.stop:
            return text[:max(0, len(text) - self.params.stop_buffer_length)]
        return text


@dataclass
class ParentState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    leader: Request  # its first_scheduled_time is the request's
    kind: RequestOutputKind
    samples: list[SampleState] = field(default_factory=list)
    child_ids: list[str] = field(default_factory=list)  # the scheduler's, one per sample
    prompt_logprobs: list[PositionLogprobDict | None] | None = None
    sent_prompt_logprobs: bool = False  # DELTA: they come with the first output only
    num_timed_tokens: int = 0  # tokens reported to the latency observations (all samples)

    @property
    def finished(self) -> bool:
        return all(s.finish_reason is not None for s in self.samples)


class OutputProcessor:
    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.parents: dict[str, ParentState] = {}
        self.samples: dict[str, SampleState] = {}  # scheduler request id → sample
        self.pooled: dict[str, PooledState] = {}  # embedding requests (one id for both)
        self._token_text: dict[int, str] = {}
        # latency observations, for whoever reports them (the server's AsyncLLM sets it)
        self.timings: RequestTimings | None = None

    def add(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
            children: list[Request]) -> None:
        params = children[0].sampling_params
        parent = ParentState(request_id, prompt, prompt_token_ids, children[0],
                             params.output_kind)
        if params.prompt_logprobs is not None:
            parent.prompt_logprobs = [None] * len(prompt_token_ids)
        for i, child in enumerate(children):
            p = child.sampling_params
            sample = SampleState(parent, i, p, IncrementalDetokenizer(
                self.tokenizer, prompt_token_ids, p.skip_special_tokens,
                p.spaces_between_special_tokens))
            if p.logprobs is not None:
                sample.logprobs, sample.cumulative_logprob = [], 0.0
            parent.samples.append(sample)
            parent.child_ids.append(child.request_id)
            self.samples[child.request_id] = sample
        self.parents[request_id] = parent

    def add_pooling(self, request: Request) -> None:
        self.pooled[request.request_id] = PooledState(request)

    def child_ids(self, request_id: str) -> list[str]:
        if request_id in self.pooled:
            return [request_id]
        parent = self.parents.get(request_id)
        return [] if parent is None else list(parent.child_ids)

    def remove(self, request_id: str) -> None:
        for cid in self.child_ids(request_id):
            self.samples.pop(cid, None)
        self.parents.pop(request_id, None)
        self.pooled.pop(request_id, None)
        if self.timings is not None:
            self.timings.forget(request_id)

    def is_known(self, request_id: str) -> bool:
        return request_id in self.parents or request_id in self.pooled

    def request_ids(self) -> list[str]:
        """Every unfinished user request, generating or embedding."""
        return [*self.parents, *self.pooled]

    def final_output(self, request_id: str, finish_reason: str,
                     error: str | None = None
                     ) -> RequestOutput | EmbeddingRequestOutput | None:
        """The output of a request ended from outside a step (abort, deadline, failure), with
        `finish_reason` on every sample still running; None if it is unknown or done. The
        caller then removes the request (LLMEngine.abort_request)."""
        if (pooled := self.pooled.get(request_id)) is not None:
            return pooled.output(error or finish_reason)
        parent = self.parents.get(request_id)
        if parent is None:
            return None
        for s in parent.samples:
            if s.finish_reason is None:
                s.finish_reason = finish_reason
        out = self._make_output(parent, finished=True)
        assert out is not None  # (every kind gives a finished request its output)
        out.error = error
        return out

    def parent_id(self, sample_id: str) -> str | None:
        if sample_id in self.pooled:
            return sample_id
        sample = self.samples.get(sample_id)
        return None if sample is None else sample.parent.request_id

    def process(self, progressed: list[Request], runner_out: ModelRunnerOutput
                ) -> tuple[list[RequestOutput | EmbeddingRequestOutput], list[str]]:
        """Outputs of the requests that moved, and sample ids that hit a stop string."""
        now = time.monotonic()
        for rid, (first, n, vector) in runner_out.pooled.items():
            if (pooled := self.pooled.get(rid)) is not None:
                pooled.add(first, n, vector)
        embeddings = []
        if self.pooled:  # (without embedding requests in flight every request generates)
            embeddings = self._pooled_outputs(progressed, now)
            progressed = [r for r in progressed if r.pooling_params is None]
        for rid, (start, lps) in runner_out.prompt_logprobs.items():
            parent = self.samples[rid].parent
            for j in range(len(lps.token_ids)):
                parent.prompt_logprobs[start + j] = self._to_dict(lps, j)
        stopped = []
        touched: dict[str, ParentState] = {}
        for request in progressed:
            sample = self.samples[request.request_id]
            if self._update_sample(sample, request, runner_out.logprobs.get(request.request_id)):
                stopped.append(request.request_id)
            touched[sample.parent.request_id] = sample.parent
        outputs: list[RequestOutput | EmbeddingRequestOutput] = []
        for pid, p in touched.items():
            finished = p.finished
            if self.timings is not None:
                self._time(p, finished, now)
            if (out := self._make_output(p, finished)) is not None:
                outputs.append(out)
            if finished:
                self.remove(pid)
        return outputs + embeddings, stopped

    def _pooled_outputs(self, progressed: list[Request], now: float
                        ) -> list[EmbeddingRequestOutput]:
        """The outputs of the embedding requests among `progressed` (each finished)."""
        embeddings = []
        for request in [r for r in progressed if r.request_id in self.pooled]:
            if request.is_finished:  # (only a finished embedding request progresses)
                embeddings.append(out := self.pooled.pop(request.request_id).output())
                if self.timings is not None:
                    self.timings.pooled(out.request_id, out.metrics["arrival_time"],
                                        out.metrics.get("first_scheduled_time"),
                                        len(out.prompt_token_ids), now)
        return embeddings

    def _time(self, parent: ParentState, finished: bool, now: float) -> None:
        """Report the parent's progress since the last step to the latency observations."""
        num_tokens = sum(len(s.token_ids) for s in parent.samples)
        new, parent.num_timed_tokens = num_tokens - parent.num_timed_tokens, num_tokens
        self.timings.progress(parent.request_id, parent.leader.arrival_time,
                              parent.leader.first_scheduled_time, len(parent.prompt_token_ids),
                              new, finished, now)

    def _update_sample(self, s: SampleState, request: Request,
                       lps: PositionLogprobs | None) -> bool:
        new_ids = request.output_token_ids[len(s.token_ids):]
        s.token_ids.extend(new_ids)
        if lps is not None and s.logprobs is not None:
            # a verify step's tokens past a stop (EOS, max_tokens) were never appended
            for j in range(min(len(lps.token_ids), len(new_ids))):
                s.logprobs.append(self._to_dict(lps, j))
                s.cumulative_logprob += lps.logprobs[j][0]
        if request.is_finished:
            s.finish_reason = RequestStatus.finish_reason(request.status)
            s.stop_reason = request.stop_reason
            if new_ids and _stopped_by_token(request) and not s.params.include_stop_str_in_output:
                new_ids = new_ids[:-1]  # (module doc)
        delta = s.detok.add_tokens(new_ids)
        if not (delta and s.params.stop) or len(s.token_ids) < s.params.min_tokens:
            return False
        hit = _find_stop(s.detok.text, len(delta), s.params)
        if hit is None:
            return False
        cut, stop = hit
        s.detok.text = s.detok.text[:cut]
        stopped_before = s.finish_reason is None
        s.finish_reason, s.stop_reason = "stop", stop
        return stopped_before

    def _make_output(self, parent: ParentState, finished: bool) -> RequestOutput | None:
        """The parent's output as its kind asks; None while a FINAL_ONLY one runs."""
        if parent.kind is RequestOutputKind.FINAL_ONLY and not finished:
            return None
        prompt_logprobs = parent.prompt_logprobs
        if parent.kind is RequestOutputKind.DELTA:
            completions = [c for s in parent.samples if (c := _delta(s)) is not None]
            prompt_logprobs = None if parent.sent_prompt_logprobs else prompt_logprobs
            parent.sent_prompt_logprobs = True
        else:
            completions = [_cumulative(s) for s in parent.samples]
        return RequestOutput(
            request_id=parent.request_id, prompt=parent.prompt,
            prompt_token_ids=parent.prompt_token_ids, outputs=completions,
            finished=finished, prompt_logprobs=prompt_logprobs, metrics=self._metrics(parent),
            num_cached_tokens=parent.leader.num_cached_tokens)

    @staticmethod
    def _metrics(parent: ParentState) -> dict[str, float]:
        return {"arrival_time": parent.leader.arrival_time,
                "first_scheduled_time": parent.leader.first_scheduled_time}

    def _to_dict(self, lps: PositionLogprobs, j: int) -> PositionLogprobDict:
        out: PositionLogprobDict = {}
        for tid, lp, rank in zip(lps.token_ids[j], lps.logprobs[j], lps.ranks[j], strict=True):
            if tid not in out:
                out[tid] = Logprob(lp, rank, self._decode_token(tid))
        return out

    def _decode_token(self, token_id: int) -> str:
        text = self._token_text.get(token_id)
        if text is None:
            text = self._token_text[token_id] = self.tokenizer.decode([token_id])
        return text


def _stopped_by_token(request: Request) -> bool:
    """Whether the request's last token ended it as a stop token (EOS or a stop id; not the
    token that completed a grammar)."""
    last = request.output_token_ids[-1]
    return request.status == RequestStatus.FINISHED_STOPPED and (
        request.stop_reason == last
        or (not request.sampling_params.ignore_eos and last in request.eos_token_ids))


def _cumulative(s: SampleState) -> CompletionOutput:
    return CompletionOutput(
        index=s.index, text=s.visible_text(), token_ids=list(s.token_ids),
        finish_reason=s.finish_reason, stop_reason=s.stop_reason,
        logprobs=list(s.logprobs) if s.logprobs is not None else None,
        cumulative_logprob=s.cumulative_logprob)


def _delta(s: SampleState) -> CompletionOutput | None:
    """What the sample has not handed out yet, marked as handed out; None if nothing (no new
    tokens, no new visible text, its finish already reported)."""
    text = s.visible_text()
    new_finish = s.finish_reason is not None and not s.sent_finish
    if len(s.token_ids) == s.sent_tokens and len(text) <= s.sent_text and not new_finish:
        return None
    out = CompletionOutput(
        index=s.index, text=text[s.sent_text:], token_ids=s.token_ids[s.sent_tokens:],
        finish_reason=s.finish_reason, stop_reason=s.stop_reason,
        logprobs=s.logprobs[s.sent_logprobs:] if s.logprobs is not None else None,
        cumulative_logprob=s.cumulative_logprob)
    s.sent_tokens, s.sent_text = len(s.token_ids), max(s.sent_text, len(text))
    s.sent_logprobs = len(s.logprobs) if s.logprobs is not None else 0
    s.sent_finish = s.finish_reason is not None
    return out


def _find_stop(text: str, delta_len: int, params: SamplingParams) -> tuple[int, str] | None:
    """(where the text ends, the stop string) for the earliest stop string ending in the new
    text; the text is cut before it, or after it with include_stop_str_in_output."""
    best: tuple[int, str] | None = None
    for stop in params.stop:
        start = text.find(stop, max(0, len(text) - delta_len - len(stop) + 1))
        if start != -1 and (best is None or start < best[0]):
            best = (start, stop)
    if best is None:
        return None
    start, stop = best
    return (start + len(stop) if params.include_stop_str_in_output else start), stop
