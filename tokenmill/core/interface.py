"""The contract between the scheduler and the model runner.

`Scheduler.schedule()` returns a `SchedulerOutput`; the runner executes it (with the step's
`GrammarOutput` beside it, when a scheduled request is constrained) and returns a
`ModelRunnerOutput`; `Scheduler.update_from_output(sched_out, runner_out)` applies it.

A `SchedulerOutput` is a diff, cheap to send to worker processes (vLLM v1's contract): a request
the runner does not hold comes once as `NewRequestData` (prompt, outputs so far, sampling
parameters, block table); after that only what changed comes, as `CachedRequestData`; each step
then says per request how many tokens to compute from where (`RequestStep`). The runner keeps
the requests' tokens and block tables (worker/request_states.py) and drops a request when its id
is in `finished_req_ids` or `preempted_req_ids` (a preempted request comes back as new).

Invariants:
- diffs are absolute (`token_start`: the tokens from there are these; `block_start`: the
  table is cut there, then extended), so applying one twice is harmless (the engine
  re-executes requests of a failed step alone with their diffs);
- the runner applies, in order: finished and preempted drops, new requests, cached diffs;
- after applying a step's diffs the runner's block tables equal the scheduler's and its token
  lists start with the scheduler's (the runner also keeps the tokens it sampled, which an
  async-scheduled step feeds before the scheduler knows them).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tokenmill.kv_offload.ops import OffloadOps, OffloadResult
from tokenmill.sampling_params import SamplingParams

if TYPE_CHECKING:
    from concurrent.futures import Future

    import torch

    from tokenmill.lora.request import AdapterRef


@dataclass(kw_only=True)
class _DraftWork:
    """Speculative decoding's share of a step (RequestStep and ScheduledRequest carry it
    alike): the drafts fed after the last token, which the step samples at the last
    1 + len(spec_token_ids) positions and verifies, the bans at draft position j (>= 1) being
    spec_banned_token_ids[j - 1]."""

    spec_token_ids: list[int] = field(default_factory=list)
    spec_banned_token_ids: list[list[int]] = field(default_factory=list)
    # (len(spec_token_ids), V): the distribution each draft was sampled from (a draft model's,
    # for a sampled request); None: drafts chosen outright (lookups, greedy drafts), one-hot
    spec_draft_probs: torch.Tensor | None = None
    # A draft model's work after this step (vLLM's num_lookahead_tokens): draft this many
    # tokens past the ones the step emits, into slots the scheduler has reserved.
    num_lookahead_tokens: int = 0

    @property
    def num_sample_positions(self) -> int:
        """Positions whose logits this step samples: the last one, and one per draft."""
        return 1 + len(self.spec_token_ids) if self.sample else 0  # sample: the subclass's


@dataclass
class NewRequestData:
    """A request the runner does not hold yet (first scheduled, or resumed after preemption)."""

    req_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # non-empty for a request resumed after preemption
    sampling_params: SamplingParams
    block_ids: list[int]
    lora: AdapterRef | None = None  # the adapter it runs with


@dataclass
class CachedRequestData:
    """What changed in a request the runner holds: its tokens from index `token_start` (of
    prompt + outputs) and its block table from index `block_start` (copy-on-write may replace
    a block, so a table is not only appended to)."""

    req_id: str
    token_start: int
    new_token_ids: list[int]
    block_start: int
    new_block_ids: list[int]


@dataclass
class RequestStep(_DraftWork):
    """One request's share of a step: compute its tokens [start_pos, start_pos +
    num_new_tokens), then the draft tokens after them."""

    req_id: str
    start_pos: int  # num_computed_tokens before this step
    num_new_tokens: int  # of the request's own tokens (drafts not counted)
    sample: bool  # True when this step reaches the request's last known token
    banned_token_ids: list[int] = field(default_factory=list)  # min_tokens: EOS/stop ids
    # an embedding request's pooling ("LAST" / "MEAN"): the runner returns its hidden states
    # (worker/pooler.py) and samples nothing; None for a generating request
    pooling: str | None = None

    @property
    def num_tokens(self) -> int:
        return self.num_new_tokens + len(self.spec_token_ids)


@dataclass
class ScheduledRequest(_DraftWork):
    """A `RequestStep` resolved by the runner against the request's state: compute `token_ids`
    at positions start_pos, start_pos+1, …; the lists are the runner's own (read-only here)."""

    req_id: str
    token_ids: list[int]  # the tokens to feed this step
    start_pos: int  # num_computed_tokens before this step
    block_ids: list[int]  # the request's whole block table after allocation
    sample: bool  # True when this step reaches the request's last known token
    sampling_params: SamplingParams
    prompt_token_ids: list[int] = field(default_factory=list)
    output_token_ids: list[int] = field(default_factory=list)
    banned_token_ids: list[int] = field(default_factory=list)  # min_tokens: EOS/stop ids
    pooling: str | None = None  # as RequestStep.pooling
    lora: AdapterRef | None = None  # the adapter it runs with
    # token_ids ends with the drafts (_DraftWork)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def prompt_logprob_positions(self) -> range:
        """Positions of this step whose next token is a prompt token (for prompt_logprobs)."""
        if self.sampling_params.prompt_logprobs is None:
            return range(0)
        end = min(self.start_pos + self.num_tokens, len(self.prompt_token_ids) - 1)
        return range(self.start_pos, max(self.start_pos, end))


@dataclass
class SchedulerOutput:
    scheduled: list[RequestStep] = field(default_factory=list)
    new_requests: list[NewRequestData] = field(default_factory=list)
    cached_requests: list[CachedRequestData] = field(default_factory=list)
    finished_req_ids: set[str] = field(default_factory=set)  # since the last step
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)  # (src, dst), before fwd
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)  # (gpu, cpu)
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)  # (cpu, gpu)
    preempted_req_ids: list[str] = field(default_factory=list)
    kv_offload: OffloadOps | None = None  # copies to and from the KV tiers (kv_offload/ops.py)

    @property
    def num_scheduled_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled

    @property
    def is_noop(self) -> bool:
        """Nothing for the runners to do (no request, no block operation, nothing ended)."""
        return not (self.scheduled or self.finished_req_ids or self.blocks_to_copy
                    or self.blocks_to_swap_out or self.blocks_to_swap_in
                    or self.preempted_req_ids or self.kv_offload)

    def for_request(self, index: int) -> SchedulerOutput:
        """The step of `scheduled[index]` alone, with its diffs (harmless if applied already)
        and no block operations: for re-executing one request of a failed step."""
        req_id = self.scheduled[index].req_id
        return SchedulerOutput(
            scheduled=[self.scheduled[index]],
            new_requests=[d for d in self.new_requests if d.req_id == req_id],
            cached_requests=[d for d in self.cached_requests if d.req_id == req_id])


@dataclass
class GrammarOutput:
    """Structured outputs' share of a step, beside its SchedulerOutput (vLLM's GrammarOutput):
    req_id → (num_sample_positions, W) int32 token bitmask rows of the constrained requests,
    being filled on a worker thread while the forward pass runs (structured_output/
    manager.py), a Future until they are waited for (`resolved`)."""

    bitmasks: Future[dict[str, torch.Tensor]] | dict[str, torch.Tensor]

    def masks(self) -> dict[str, torch.Tensor]:
        """The masks, waiting for them if they are still being filled."""
        return self.bitmasks if isinstance(self.bitmasks, dict) else self.bitmasks.result()

    def resolved(self) -> GrammarOutput:
        """This output with its masks filled (a Future does not cross processes)."""
        return self if isinstance(self.bitmasks, dict) else GrammarOutput(self.masks())


@dataclass
class PositionLogprobs:
    """Logprobs at consecutive positions; entry i holds the chosen token then the top-k."""

    token_ids: list[list[int]]
    logprobs: list[list[float]]
    ranks: list[list[int]]  # 1 = most likely


@dataclass
class ModelRunnerOutput:
    req_ids: list[str]
    # parallel to req_ids; [] for a request that did not sample; with drafts, the accepted
    # drafts then one sampled token (1 to 1 + len(spec_token_ids) tokens)
    sampled_token_ids: list[list[int]]
    logprobs: dict[str, PositionLogprobs] = field(default_factory=dict)  # sampled tokens
    # req_id → (index of the first prompt token covered, its logprobs)
    prompt_logprobs: dict[str, tuple[int, PositionLogprobs]] = field(default_factory=dict)
    # req_id → a draft model's drafts continuing the tokens this step emitted (requests with
    # num_lookahead_tokens > 0 that sampled), for the scheduler to verify next step
    draft_token_ids: dict[str, list[int]] = field(default_factory=dict)
    # req_id → (len(drafts), V) the distributions those drafts were sampled from, for sampled
    # requests (greedy ones' drafts are one-hot and have none)
    draft_probs: dict[str, torch.Tensor] = field(default_factory=dict)
    # req_id → (first prompt position covered, number of positions, (H,) float32): an
    # embedding request's share of this step, the sum of its positions' final hidden states
    # (MEAN) or its last prompt position's (LAST, only in the step that reaches it)
    pooled: dict[str, tuple[int, int, torch.Tensor]] = field(default_factory=dict)
    kv_offload: OffloadResult | None = None  # the step's KV tier reads and writes
