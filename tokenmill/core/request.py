"""Request: one generation request as the scheduler sees it.

Invariants:
- `all_token_ids == prompt_token_ids + output_token_ids`; `num_tokens == len(all_token_ids)`.
- `0 <= num_computed_tokens <= num_tokens`: the tokens whose K/V sit in the cache. The scheduler
  drives everything from this one number: prefill chunks, decode, resumption after preemption
  (reset to 0: recompute), prefix-cache hits and speculative tokens.
- `spec_token_ids`: draft tokens scheduled after the last token and not yet verified. Between
  `schedule()` and `update_from_output()` they are counted in `num_computed_tokens` (their
  K/V is being written), which may then exceed `num_tokens` by their number; verification
  rolls it back to the accepted ones. They never enter `all_token_ids` unverified.
- `lora`: the adapter the request runs with, fixed for its life; its KV blocks are cached
  under the adapter's key and shared only with requests of the same adapter.
- `grammar` (structured outputs): a matcher whose state is `output_token_ids`; the scheduler
  advances it on every token it appends.
"""

from __future__ import annotations

import enum
import time
from typing import TYPE_CHECKING

from tokenmill.pooling_params import PoolingParams
from tokenmill.sampling_params import SamplingParams
from tokenmill.spec_decode.policy import INITIAL_ACCEPTANCE

if TYPE_CHECKING:
    from tokenmill.lora.request import AdapterRef


class RequestStatus(enum.IntEnum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    SWAPPED = enum.auto()  # preempted with its KV copied to CPU swap space
    PREEMPTED = enum.auto()  # preempted for recomputation
    # Everything after this point is finished.
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_ERROR = enum.auto()  # e.g. its grammar reached a dead end (stop_reason says)

    @staticmethod
    def is_finished(status: RequestStatus) -> bool:
        return status > RequestStatus.PREEMPTED

    @staticmethod
    def finish_reason(status: RequestStatus) -> str | None:
        return _FINISH_REASONS.get(status)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


class Request:
    def __init__(self, request_id: str, prompt_token_ids: list[int],
                 sampling_params: SamplingParams, eos_token_ids: list[int], max_tokens: int,
                 arrival_time: float | None = None,
                 pooling_params: PoolingParams | None = None,
                 lora: AdapterRef | None = None, priority: int = 0) -> None:
        self.request_id = request_id
        # lower is served first under the priority policy (core/scheduling_policy.py)
        self.priority = priority
        # the LoRA adapter it runs with (None: the base model); its KV is its adapter's
        self.lora = lora
        # an embedding request: computes its prompt, samples nothing, finishes when the
        # prompt is computed (its sampling_params are unused)
        self.pooling_params = pooling_params
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_ids = frozenset(eos_token_ids)
        self.max_tokens = max_tokens  # resolved: never None here
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time

        self.output_token_ids: list[int] = []
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.num_computed_tokens = 0
        # prompt tokens found computed (prefix cache, KV tiers) when first admitted; None before
        # (vLLM's num_cached_tokens: the usage's cached_tokens)
        self.num_cached_tokens: int | None = None
        # sampling steps scheduled whose token has not come back yet (async scheduling runs
        # up to one step ahead; with synchronous steps this is 0 between steps)
        self.num_output_placeholders = 0
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        self.num_preemptions = 0
        self.first_scheduled_time: float | None = None  # for the queue-time metric
        self.spec_token_ids: list[int] = []  # drafts in flight this step (see the invariants)
        self.proposed_token_ids: list[int] = []  # a draft model's, for the next step to verify
        self.proposed_probs = None  # and the distributions it sampled them from (or None)
        self.spec_acceptance = INITIAL_ACCEPTANCE  # running, per draft token (spec_decode/policy)
        # structured outputs: a GrammarMatcher (structured_output/backend.py), or None
        self.grammar = None
        # bad_words as token sequences (request_intake.py); a sequence's last token is
        # banned where the output ends with the rest of it
        self.bad_words: tuple[tuple[int, ...], ...] = ()

    @property
    def lora_key(self) -> str | None:
        """The adapter's identity (a hash of its weights), None for the base model."""
        return None if self.lora is None else self.lora.key

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def pooling_type(self) -> str | None:
        """"LAST" / "MEAN" for an embedding request, None for a generating one."""
        return None if self.pooling_params is None else self.pooling_params.pooling_type

    @property
    def needs_every_prompt_position(self) -> bool:
        """Prompt logprobs and mean pooling read every prompt position's output: no
        prefix-cache hit may skip computing some."""
        return (self.sampling_params.prompt_logprobs is not None
                or self.pooling_type == "MEAN")

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return RequestStatus.is_finished(self.status)

    def banned_token_ids(self, ahead: int = 0) -> list[int]:
        """Tokens the sampler must not pick now (or `ahead` tokens from now, for a draft
        position): EOS and stop ids until min_tokens are out."""
        params = self.sampling_params
        banned = self._bad_word_ends(ahead) if self.bad_words else []
        if self.num_output_tokens + ahead >= params.min_tokens:
            return banned
        eos = [] if params.ignore_eos else sorted(self.eos_token_ids)
        return eos + params.stop_token_ids + banned

    @property
    def has_long_bad_words(self) -> bool:
        """Whether a bad word spans several tokens: its ban depends on the tokens before
        it, so the request is never scheduled ahead of its sampled token nor drafted."""
        return any(len(seq) > 1 for seq in self.bad_words)

    def _bad_word_ends(self, ahead: int) -> list[int]:
        """The last tokens of the bad words whose other tokens end the output (ahead > 0,
        where the tokens before are not known yet, only one-token words count: the
        scheduler waits for them first, has_long_bad_words)."""
        out = self.output_token_ids
        return sorted({seq[-1] for seq in self.bad_words
                       if len(seq) == 1 or (ahead == 0 and len(out) >= len(seq) - 1
                                            and tuple(out[len(out) - len(seq) + 1:]) == seq[:-1])})

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, status={self.status.name}, "
                f"tokens={self.num_tokens}, computed={self.num_computed_tokens})")
