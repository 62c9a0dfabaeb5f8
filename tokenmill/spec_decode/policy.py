"""How many draft tokens pay for a request this step.

A verify step with k drafts at per-token acceptance a emits 1 + a + ... + a^k tokens on
average and costs about V(k) + d k plain decode steps: V(k) the verify step itself (on CPU the
linear kernels' work grows with the rows of a step even where the weights are read once: on
SmolLM2 with 2 cores a 4-token step costs 1.6-1.7x a 1-token one, about 1 + 0.21 k; longer
steps leave the fused decode call), d for making a draft (0 for a lookup, a forward for a
draft model); both are measured when the engine starts (cost_model.py). The
policy takes the k in 0..K with the most tokens per unit of cost, from each request's running
acceptance: an exponential moving average over the draft positions it has verified (a
rejected position counts once, the positions after it are not observed), starting at 0.5.
Open-ended text (acceptance ~10%) then stops drafting instead of paying for rejected verify
work; a request whose estimate is low still gets one draft when the proposer's match is as
long as it looks for, so that a passage that starts repeating is noticed.
"""

from __future__ import annotations

from dataclasses import dataclass

# Drafts of several requests share steps of at most this many tokens (or 1 + K for a larger
# num_speculative_tokens K): up to 4 rows the CPU kernels read each weight once for all of
# them and the fused decode call takes the step (models/cpu_decode.py).
SPEC_MAX_STEP_TOKENS = 4
# Costs before (or without) measuring them (cost_model.py), from SmolLM2 on 2 cores:
VERIFY_COST_PER_DRAFT = 0.21
# One forward of a draft model for one token, in target decode steps: SmolLM2's own GGUF Q4_1
# blocks drafting for its float32 expansion (5.1 ms against 11.7 ms, 2 cores, AVX-512).
DRAFT_MODEL_COST = 0.44
INITIAL_ACCEPTANCE = 0.5
# A draft model is made to agree with its target (the target's own weights quantized agree on
# 95-100% of SmolLM2's tokens): it starts drafting at once, and its acceptance decides after.
DRAFT_MODEL_INITIAL_ACCEPTANCE = 0.9
_ALPHA = 0.2  # weight of one verified position in the running acceptance


def spec_step_tokens(num_speculative_tokens: int) -> int:
    """The most tokens a step with drafts holds (all requests' together)."""
    return max(SPEC_MAX_STEP_TOKENS, 1 + num_speculative_tokens)


def draft_length(acceptance: float, available: int, long_match: bool,
                 verify_cost: float = VERIFY_COST_PER_DRAFT, draft_cost: float = 0.0,
                 verify_curve: tuple[float, ...] = ()) -> int:
    """Drafts to verify out of `available`, at running per-token `acceptance`. Costs in plain
    decode steps (measured at start-up: cost_model.py): a step verifying k drafts
    `verify_curve[k]` (where measured; else 1 + verify_cost * k), `draft_cost` to make one
    draft (0 for a lookup, a forward for a draft model)."""
    best, best_rate = 0, 1.0  # no drafts: one token per plain step
    expected = 1.0
    for k in range(1, available + 1):
        expected += acceptance ** k
        verify = verify_curve[k] if k < len(verify_curve) else 1 + verify_cost * k
        rate = expected / (verify + draft_cost * k)
        if rate > best_rate:
            best, best_rate = k, rate
    return max(best, 1 if long_match and available else 0)


def update_acceptance(acceptance: float, accepted: int, drafted: int) -> float:
    """The running acceptance after a verify step that accepted `accepted` of `drafted`."""
    for j in range(min(accepted + 1, drafted)):
        acceptance += _ALPHA * ((1.0 if j < accepted else 0.0) - acceptance)
    return acceptance


@dataclass(frozen=True)
class SpecCosts:
    """What drafting costs, in plain decode steps (measured at start-up: cost_model.py)."""

    verify_per_draft: float  # a verify step's extra cost per draft token, in decode steps
    draft_forward: float = 0.0  # one draft-model forward of one token, in decode steps
    # a step verifying k drafts, in decode steps, k = 0 .. K (measured; [0] is 1.0); past
    # its end (or empty) 1 + verify_per_draft * k
    verify_curve: tuple[float, ...] = ()
