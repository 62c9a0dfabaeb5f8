"""What the engine hands back to users: `RequestOutput` holding one `CompletionOutput` per sample.

Field names follow vLLM (`prompt`, `prompt_token_ids`, `prompt_logprobs`, `outputs[i].text`,
`.token_ids`, `.logprobs`, `.cumulative_logprob`, `.finish_reason`, `.stop_reason`), so code
written against vLLM reads these unchanged. `finish_reason` is None while a sample is running,
then "stop" (EOS, a stop token or string) or "length" (max_tokens or the context length);
"abort" marks a request the caller aborted (or that hit its deadline, or a server shutdown), and
"error" one whose step failed: `RequestOutput.error` then says why (the other requests of that
step carry on). `stop_reason` is the stop token id or string that
ended it (None for EOS or length).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None  # 1 = the most likely token
    decoded_token: str | None = None


# One position: token id → Logprob, the chosen token first, then the top-k alternatives.
PositionLogprobDict = dict[int, Logprob]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list[PositionLogprobDict] | None = None
    cumulative_logprob: float | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    prompt_logprobs: list[PositionLogprobDict | None] | None = None
    metrics: dict[str, float] = field(default_factory=dict)
    error: str | None = None  # set when the request failed inside the engine
    # prompt tokens served from the prefix cache or a KV tier (vLLM's); None until scheduled
    num_cached_tokens: int | None = None


@dataclass
class EmbeddingOutput:
    embedding: list[float]  # (dimensions,) float32 values as Python floats


@dataclass
class EmbeddingRequestOutput:
    """An embedding request's result (vLLM's `EmbeddingRequestOutput`): `outputs.embedding`.
    `error` is set (and the embedding empty) when the request failed or was aborted."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput
    finished: bool = True
    error: str | None = None
    metrics: dict[str, float] = field(default_factory=dict)


def coalesce(earlier: RequestOutput, later: RequestOutput, delta: bool) -> RequestOutput:
    """One output standing for two consecutive outputs of a request that its reader has not
    taken yet (what vLLM's output collector does for a reader slower than the steps).

    A CUMULATIVE or FINAL_ONLY output holds everything so far: the later one stands for both.
    DELTA outputs are joined sample by sample: text, tokens and logprobs in order, the later
    finish and cumulative logprob; prompt logprobs come with the first output only.
    """
    if not delta:
        return later
    samples = {c.index: c for c in earlier.outputs}
    for c in later.outputs:
        before = samples.get(c.index)
        samples[c.index] = c if before is None else CompletionOutput(
            index=c.index, text=before.text + c.text, token_ids=before.token_ids + c.token_ids,
            finish_reason=c.finish_reason, stop_reason=c.stop_reason,
            logprobs=(None if c.logprobs is None else (before.logprobs or []) + c.logprobs),
            cumulative_logprob=c.cumulative_logprob)
    prompt_logprobs = (earlier.prompt_logprobs if earlier.prompt_logprobs is not None
                       else later.prompt_logprobs)
    return RequestOutput(
        request_id=later.request_id, prompt=later.prompt, prompt_token_ids=later.prompt_token_ids,
        outputs=[samples[i] for i in sorted(samples)], finished=later.finished,
        prompt_logprobs=prompt_logprobs, metrics=later.metrics, error=later.error,
        num_cached_tokens=later.num_cached_tokens)
