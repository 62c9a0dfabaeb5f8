"""Speculative decoding's share of scheduling, a policy object of the scheduler
(core/scheduler.py): the draft tokens a decoding request is given this step, how many a draft
model drafts after it, and what a verified step did to the request and the metrics.

A decoding request may get draft tokens after its last token (`Request.spec_token_ids`), from
the step's token budget; the runner verifies them and `on_verified` rolls
`num_computed_tokens` back past the rejected ones (their K/V slots are simply overwritten
later). Lookup drafts (n-gram, suffix) are made here at schedule time; a draft model's are
made by the runner after a step, for requests given lookahead slots for their K/V, and
scheduled the step after (`Request.proposed_token_ids`). Drafts go only to steps small enough
that verifying stays cheap (spec_decode/policy.py spec_step_tokens: 4 tokens, or
1 + num_speculative_tokens where that is larger), and only as many as the request's running
acceptance and the measured cost of such steps make worth it (spec_decode/policy.py,
cost_model.py).

Invariants: no draft passes max_tokens or the model's length (`tokens_left`); without a
speculative config every method gives nothing and changes nothing.
"""

from __future__ import annotations

from tokenmill.core.request import Request
from tokenmill.spec_decode import SpeculativeConfig, make_proposer
from tokenmill.spec_decode.policy import (
    DRAFT_MODEL_COST,
    DRAFT_MODEL_INITIAL_ACCEPTANCE,
    VERIFY_COST_PER_DRAFT,
    SpecCosts,
    draft_length,
    spec_step_tokens,
    update_acceptance,
)

# A draft model whose acceptance says drafting does not pay still drafts once every this many
# output tokens, so that its running acceptance can recover.
PROBE_EVERY = 8


class SpecPolicy:
    """Drafts and lookahead per request, acceptance and vLLM's spec_decode counters."""

    def __init__(self, speculative: SpeculativeConfig | None,
                 costs: SpecCosts | None = None) -> None:
        self.speculative = speculative
        self.num_speculative_tokens = speculative.num_speculative_tokens if speculative else 0
        # what drafting costs, in decode steps (measured by the runner at start-up)
        self.costs = costs or SpecCosts(VERIFY_COST_PER_DRAFT, DRAFT_MODEL_COST)
        self.step_tokens = spec_step_tokens(self.num_speculative_tokens)
        # n-gram and suffix drafts are made here; a draft model's come from the runner
        self.proposer = make_proposer(speculative)
        self.draft_model = speculative is not None and speculative.method == "draft_model"
        # vLLM's metrics: verify events, draft tokens, accepted ones, accepted by position
        self.num_drafts = self.num_draft_tokens = self.num_accepted_tokens = 0
        self.num_accepted_per_pos = [0] * self.num_speculative_tokens

    def on_add(self, request: Request) -> None:
        if self.draft_model:
            request.spec_acceptance = DRAFT_MODEL_INITIAL_ACCEPTANCE

    def drafts(self, request: Request, n: int, room: int, tokens_left: int) -> list[int]:
        """Draft tokens for a decoding request (n = 1), at most `room` of them."""
        if self.speculative is None or n != 1 or room <= 0:
            return []
        k = min(self.num_speculative_tokens, room, tokens_left - 1)
        if k <= 0:
            return []
        if self.proposer is None:  # a draft model's, proposed after the last step
            return request.proposed_token_ids[:k]
        drafts, matched = self.proposer.propose_with_match(request.all_token_ids, k)
        long_match = matched >= self.proposer.confident_match
        return drafts[:draft_length(request.spec_acceptance, len(drafts), long_match,
                                    self.costs.verify_per_draft,
                                    verify_curve=self.costs.verify_curve)]

    def lookahead(self, request: Request, n: int, running: int, tokens_left: int) -> int:
        """How many tokens a draft model drafts for the request after this step: for a
        decoding request (not after its prompt, whose first draft would run the draft model
        over the whole prompt before the first token is returned), in a batch of `running`
        requests small enough for the next step to verify them (step_tokens split evenly), as
        many as its acceptance makes worth it (one every PROBE_EVERY tokens when none is, so
        that its acceptance can recover)."""
        if (not self.draft_model or n != 1 or request.num_output_tokens == 0
                or request.num_computed_tokens + 1 != request.num_tokens):
            return 0
        k = min(self.num_speculative_tokens, (self.step_tokens - running) // running,
                tokens_left - 2)  # this step emits at least one
        if k <= 0:
            return 0
        probe = request.num_output_tokens % PROBE_EVERY == 0
        return draft_length(request.spec_acceptance, k, probe, self.costs.verify_per_draft,
                            self.costs.draft_forward, self.costs.verify_curve)

    def on_verified(self, request: Request, num_emitted: int) -> None:
        """A step verified the request's drafts and emitted `num_emitted` tokens (the
        accepted drafts, then one sampled): roll back past the rejected ones, update its
        acceptance and the counters."""
        drafts = request.spec_token_ids
        if not drafts:
            return
        accepted = num_emitted - 1
        request.num_computed_tokens -= len(drafts) - accepted
        request.spec_acceptance = update_acceptance(request.spec_acceptance, accepted,
                                                    len(drafts))
        self.num_drafts += 1
        self.num_draft_tokens += len(drafts)
        self.num_accepted_tokens += accepted
        for j in range(accepted):
            self.num_accepted_per_pos[j] += 1
        request.spec_token_ids = []

    def on_finish(self, request: Request) -> None:
        if self.proposer is not None:  # the suffix proposer learns from finished outputs
            self.proposer.observe_output(request.request_id, request.output_token_ids)
