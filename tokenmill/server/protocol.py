"""Pydantic models of the OpenAI API subset we serve, with vLLM's extra sampling fields.

Validation happens here, at the edge, so that nothing a client sends can reach the engine in a
form its ops do not accept:
- strict types: no bool where a number is expected, no string where a bool is; finite floats
  only; integers within signed 64 bits where they become tensor values (seed, top_k);
- every string must be encodable as UTF-8 (a lone surrogate such as "\\ud800" is a 400);
- unknown fields are refused with a 400 naming them (`extra="forbid"`), and OpenAI fields that
  tokenmill does not implement yet (`audio`, `prediction`, `best_of`...) are refused by name
  unless they carry their inert default;
- structured outputs come as OpenAI's `response_format` (json_object, json_schema), vLLM's
  `structured_outputs` object, or vLLM's older `guided_json` / `guided_regex` /
  `guided_choice` / `guided_grammar` (+ `guided_whitespace_pattern`); at most one of them;
- `n` is capped at MAX_N, the number of prompts at MAX_PROMPTS.

Requests turn into SamplingParams in `to_sampling_params`; SamplingParams' own validation then
raises ValueError naming the field, which the server returns as a 400 in the OpenAI shape.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    field_validator,
    model_validator,
)

from tokenmill.sampling_params import (
    SEED_MAX,
    SEED_MIN,
    RequestOutputKind,
    SamplingParams,
)
from tokenmill.structured_output.params import StructuredOutputsParams

MAX_N = 128  # OpenAI's own cap on n
MAX_PROMPTS = 256  # prompts in one /v1/completions request
INT64_MAX = 2**63 - 1
INT64_MIN = -(2**63)


def _utf8(text: str) -> str:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"text is not valid Unicode ({e.reason} at position {e.start})") from None
    return text


Text = Annotated[str, AfterValidator(_utf8)]
TokenId = Annotated[StrictInt, Field(ge=0, le=INT64_MAX)]
Float = Annotated[float, Field(allow_inf_nan=False)]


class StrictModel(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)


class StreamOptions(StrictModel):
    include_usage: bool = False  # a last chunk with the request's usage
    # vLLM's: with include_usage, every chunk also carries its choice's usage so far
    continuous_usage_stats: bool = False


# OpenAI fields tokenmill does not implement yet → the values that mean "not used" (and
# best_of, which is inert when it equals n).
# vLLM's neutral sampling values, for what neither a request nor the server's defaults set
_NEUTRAL_SAMPLING: dict[str, Any] = {
    "temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "presence_penalty": 0.0,
    "frequency_penalty": 0.0, "repetition_penalty": 1.0}

_INERT: dict[str, Any] = {
    "functions": (None,),
    "function_call": (None, "none"), "audio": (None,), "modalities": (None, ["text"]),
    "prediction": (None,), "store": (None, False), "web_search_options": (None,),
}


class JsonSchemaFormat(StrictModel):
    name: Text = "response"
    description: Text | None = None
    # `schema` in the API (pydantic reserves the attribute name)
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: StrictBool | None = None


class ResponseFormat(StrictModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class SamplingFields(StrictModel):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: Text | None = None
    max_tokens: StrictInt | None = None
    temperature: Float | None = None
    top_p: Float | None = None
    n: Annotated[StrictInt, Field(ge=1, le=MAX_N)] = 1
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    stop: Text | list[Text] | None = None
    seed: Annotated[StrictInt, Field(ge=SEED_MIN, le=SEED_MAX)] | None = None
    presence_penalty: Float | None = None
    frequency_penalty: Float | None = None
    logit_bias: dict[str, Float] | None = None
    user: Text | None = None
    metadata: dict[str, Text] | None = None
    # not implemented: refused unless inert (see _INERT)
    best_of: StrictInt | None = None
    store: StrictBool | None = None
    functions: Any = None
    function_call: Any = None
    audio: Any = None
    modalities: Any = None
    prediction: Any = None
    web_search_options: Any = None
    # tokenmill: seconds after which the request is aborted (finish_reason "abort")
    timeout: Annotated[Float, Field(gt=0)] | None = None
    # vLLM extras
    priority: Annotated[StrictInt, Field(ge=INT64_MIN, le=INT64_MAX)] = 0  # lower first
    top_k: Annotated[StrictInt, Field(ge=-1, le=INT64_MAX)] | None = None
    min_p: Float | None = None
    repetition_penalty: Float | None = None
    ignore_eos: StrictBool = False
    min_tokens: StrictInt = 0
    skip_special_tokens: StrictBool = True
    spaces_between_special_tokens: StrictBool = True
    include_stop_str_in_output: StrictBool = False
    return_tokens_as_token_ids: StrictBool | None = None  # logprobs' tokens as "token_id:N"
    stop_token_ids: list[TokenId] | None = None
    allowed_token_ids: list[TokenId] | None = None  # only these may be sampled
    bad_words: list[Text] | None = None  # never generated
    # at most this many reasoning tokens, then the end of thinking (--reasoning-parser)
    thinking_token_budget: Annotated[StrictInt, Field(ge=0)] | None = None
    truncate_prompt_tokens: StrictInt | None = None  # the prompt's last k tokens (-1: the model's)
    prompt_logprobs: StrictInt | None = None
    # structured outputs (see the module doc)
    response_format: ResponseFormat | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: Text | dict[str, Any] | None = None
    guided_regex: Text | None = None
    guided_choice: list[Text] | None = None
    guided_grammar: Text | None = None
    guided_whitespace_pattern: Text | None = None

    @model_validator(mode="after")
    def _refuse_unimplemented(self) -> SamplingFields:
        unsupported = [name for name, inert in _INERT.items() if getattr(self, name) not in inert]
        if self.best_of not in (None, self.n):
            unsupported.insert(0, "best_of")
        if unsupported:
            raise ValueError(f"{unsupported[0]} is not supported by tokenmill yet")
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed with stream=true")
        if self.prompt_logprobs is not None and self.stream:
            raise ValueError("prompt_logprobs is not available with stream=true")
        return self

    def _sampling_params(self, max_tokens: int | None, logprobs: int | None,
                         defaults: Mapping[str, Any],
                         prompt_logprobs: int | None = None) -> SamplingParams:
        """The request's sampling: each value it sets, else the server's default
        (`defaults`: the model's generation config), else vLLM's neutral one."""
        chosen = {name: (value if (value := getattr(self, name)) is not None
                         else defaults.get(name, neutral))
                  for name, neutral in _NEUTRAL_SAMPLING.items()}
        return SamplingParams(
            n=self.n, **chosen, seed=self.seed, stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            include_stop_str_in_output=self.include_stop_str_in_output,
            ignore_eos=self.ignore_eos, max_tokens=max_tokens,
            min_tokens=self.min_tokens, logprobs=logprobs,
            prompt_logprobs=(self.prompt_logprobs if self.prompt_logprobs is not None
                             else prompt_logprobs),
            logit_bias=self.logit_bias, skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens,
            structured_outputs=self.structured_outputs_params(),
            allowed_token_ids=self.allowed_token_ids, bad_words=self.bad_words,
            thinking_token_budget=self.thinking_token_budget,
            truncate_prompt_tokens=self.truncate_prompt_tokens,
            # as vLLM's server asks: a stream, what is new at each step (nothing the engine
            # builds grows with the answer; serving_common.StreamedChoices adds it up); a
            # response sent whole, only the final output (none for the steps in between)
            output_kind=(RequestOutputKind.DELTA if self.stream
                         else RequestOutputKind.FINAL_ONLY))

    def structured_outputs_params(self) -> StructuredOutputsParams | None:
        """The one structured-output constraint the request sets, or None; ValueError naming
        the field if it sets several or a bad one."""
        guided = {k: getattr(self, f"guided_{k}") for k in ("json", "regex", "choice", "grammar")
                  if getattr(self, f"guided_{k}") is not None}
        fmt = self.response_format
        sources = [name for name, present in (
            ("response_format", fmt is not None and fmt.type != "text"),
            ("structured_outputs", self.structured_outputs is not None),
            ("guided_" + next(iter(guided), ""), bool(guided))) if present]
        if len(sources) > 1 or len(guided) > 1:
            names = sources + [f"guided_{k}" for k in list(guided)[1:]]
            raise ValueError(f"structured_outputs is only allowed once: {', '.join(names)} "
                             "each set a constraint")
        if self.guided_whitespace_pattern is not None and not guided:
            raise ValueError("guided_whitespace_pattern must come with guided_json")
        if guided:
            return StructuredOutputsParams(
                **guided, whitespace_pattern=self.guided_whitespace_pattern)
        if self.structured_outputs is not None:
            return StructuredOutputsParams.from_dict(self.structured_outputs)
        if fmt is None or fmt.type == "text":
            return None
        if fmt.type == "json_object":
            return StructuredOutputsParams(json_object=True)
        if fmt.json_schema is None:
            raise ValueError("response_format must have json_schema when its type is "
                             "json_schema")
        schema = fmt.json_schema.json_schema
        return StructuredOutputsParams(json=schema if schema is not None else {})


Prompt = Text | list[Text] | list[TokenId] | list[list[TokenId]]


def check_prompt(value: Any, name: str) -> Prompt:
    """One text, one list of token ids, or a non-empty list of either (no bools, which JSON
    parsers would otherwise read as 0 and 1); `name`: the field, for the error."""
    def is_ids(v: Any) -> bool:
        return (isinstance(v, list) and len(v) > 0
                and all(type(t) is int and 0 <= t <= INT64_MAX for t in v))

    if isinstance(value, str):
        return _utf8(value)
    if is_ids(value):
        return value
    if (isinstance(value, list) and 0 < len(value) <= MAX_PROMPTS
            and (all(isinstance(v, str) for v in value) or all(is_ids(v) for v in value))):
        return [_utf8(v) if isinstance(v, str) else v for v in value]
    if isinstance(value, list) and len(value) > MAX_PROMPTS:
        raise ValueError(f"at most {MAX_PROMPTS} prompts per request, got {len(value)}")
    raise ValueError(f"{name} must be a string, a non-empty list of token ids (integers "
                     ">= 0), or a non-empty list of strings or of token id lists")


def prompt_list(p: Prompt) -> list[Any]:
    """The prompts of a checked prompt field, one per request."""
    if isinstance(p, str) or (p and isinstance(p[0], int)):
        return [p]
    return list(p)


class CompletionRequest(SamplingFields):
    prompt: Any
    logprobs: Annotated[StrictInt, Field(ge=0)] | None = None
    echo: StrictBool = False
    suffix: Text | None = None

    @field_validator("prompt", mode="plain")
    @classmethod
    def _prompt(cls, value: Any) -> Prompt:
        return check_prompt(value, "prompt")

    def prompts(self) -> list[Any]:
        return prompt_list(self.prompt)

    def to_sampling_params(self, defaults: Mapping[str, Any] | None = None) -> SamplingParams:
        """`defaults`: the server's sampling defaults (ModelConfig.sampling_defaults)."""
        # OpenAI's completions default is 16 tokens (vLLM's too, whatever the model's)
        max_tokens = 16 if self.max_tokens is None else self.max_tokens
        if self.echo_only:
            max_tokens = 1  # (vLLM's: one token is computed, the prompt alone returned)
        # echo with logprobs: the prompt's too, as the choice's first positions
        echoed = self.logprobs if self.echo and self.logprobs is not None else None
        return self._sampling_params(max_tokens, self.logprobs, defaults or {}, echoed)

    @property
    def echo_only(self) -> bool:
        """echo with max_tokens 0: the prompt back (with its logprobs), nothing generated
        (how lm-evaluation-harness scores a text)."""
        return self.echo and self.max_tokens == 0


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0  # served from the prefix cache or a KV tier


class CompletionTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    # with --enable-prompt-tokens-details (vLLM's; else null, as vLLM sends it)
    prompt_tokens_details: PromptTokensDetails | None = None
    # chat with --reasoning-parser (vLLM's): the answers' reasoning tokens; else null
    completion_tokens_details: CompletionTokensDetails | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "tokenmill"
    root: str | None = None  # the model's path, or an adapter's folder
    parent: str | None = None  # a LoRA adapter's base model (vLLM's)
    max_model_len: int | None = None


class ErrorBody(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int


class ErrorResponse(BaseModel):
    error: ErrorBody
