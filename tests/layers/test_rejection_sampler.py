"""Verifying drafts (layers/rejection_sampler.py): every emitted token follows the target
distribution at its position whatever the draft (chi-square over 20k verifications, the
sampler tests' thresholds), in the accepted and the rejected branch and for the bonus token; a
wrong acceptance rule fails the same check; greedy rows accept while the argmax agrees;
penalties and bans at a position see the drafts before it; logprobs of the emitted tokens."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.layers.test_sampler import LOGITS, assert_follows, expected, row
from tokenmill.layers.rejection_sampler import verify
from tokenmill.layers.sampler import Sampler
from tokenmill.sampling_params import SamplingParams

CPU = torch.device("cpu")
SECOND = LOGITS.flip(0)  # another target at the second position: a different argmax


def spec_row(params: SamplingParams, drafts: list[int], req_id: str = "r", bans=None):
    return dataclasses.replace(row(params, req_id), token_ids=[0, *drafts],
                               spec_token_ids=list(drafts),
                               spec_banned_token_ids=bans or [[] for _ in drafts])


def verify_many(params: SamplingParams, drafts: list[int], positions: list[torch.Tensor],
                n: int = 20000) -> list[list[int]]:
    rows = [spec_row(params, drafts, str(i)) for i in range(n)]
    logits = torch.stack(positions).repeat(n, 1)  # (n * (k + 1), V)
    emitted, _ = verify(Sampler(1234, CPU), logits, rows)
    return emitted


@pytest.mark.parametrize("draft", [0, 3, 5])  # likely, unlikely, nearly impossible
def test_first_token_follows_the_target_whatever_the_draft(draft):
    emitted = verify_many(SamplingParams(temperature=1.0, seed=None), [draft], [LOGITS, SECOND])
    assert_follows(torch.tensor([e[0] for e in emitted]), expected(1.0))
    accepted = [e for e in emitted if len(e) == 2]
    assert accepted and all(e[0] == draft for e in accepted)
    assert all(e[0] != draft for e in emitted if len(e) == 1)  # rejected: another token


def test_bonus_and_second_position_follow_their_own_targets():
    second = torch.softmax(SECOND.double(), 0)
    emitted = verify_many(SamplingParams(temperature=1.0), [0], [LOGITS, SECOND])
    bonus = torch.tensor([e[1] for e in emitted if len(e) == 2])  # after accepting draft 0
    assert bonus.numel() > 8000
    assert_follows(bonus, second)
    emitted = verify_many(SamplingParams(temperature=1.0), [0, 5], [LOGITS, SECOND, LOGITS])
    at_second = torch.tensor([e[1] for e in emitted if len(e) >= 2])  # draft 5: often rejected
    assert_follows(at_second, second)


def test_top_k_and_temperature_shape_the_target():
    params = SamplingParams(temperature=0.7, top_k=3)
    emitted = verify_many(params, [4], [LOGITS, LOGITS])  # draft outside the top 3
    assert all(len(e) == 1 for e in emitted)  # never accepted
    assert_follows(torch.tensor([e[0] for e in emitted]), expected(0.7, top_k=3))


def test_a_wrong_acceptance_rule_fails_the_check():
    """Accepting with probability min(1, 2 p(d)) instead of p(d) is caught."""
    g = torch.Generator().manual_seed(0)
    p = expected(1.0)
    n, draft = 20000, 3
    accept = torch.rand(n, generator=g, dtype=torch.float64) < min(1.0, 2 * p[draft])
    residual = p.clone()
    residual[draft] = 0
    drawn = torch.multinomial(residual, n, replacement=True, generator=g)
    with pytest.raises(AssertionError, match="chi2"):
        assert_follows(torch.where(accept, draft, drawn), p)


def test_greedy_accepts_while_the_argmax_agrees():
    greedy = SamplingParams(temperature=0)
    rows = [spec_row(greedy, [0, 5], "a"), spec_row(greedy, [0, 0], "b"),
            spec_row(greedy, [2], "c")]
    logits = torch.stack([LOGITS, SECOND, LOGITS, LOGITS, SECOND, LOGITS, LOGITS, SECOND])
    emitted, _ = verify(Sampler(0, CPU), logits, rows)
    # a: 0 agrees, 5 agrees (SECOND's argmax), then the bonus argmax 0
    # b: 0 agrees, 0 disagrees at SECOND: its argmax 5; c: 2 disagrees: argmax 0
    assert emitted == [[0, 5, 0], [0, 5], [0]]


def test_penalties_and_bans_see_the_drafts_before_them():
    # presence 2.0 at the second position sees draft 0 as output: 2.0 - 2.0 = 0 < 1.0
    params = SamplingParams(temperature=0, presence_penalty=2.0)
    emitted, _ = verify(Sampler(0, CPU), torch.stack([LOGITS, LOGITS]),
                        [spec_row(params, [0])])
    assert emitted == [[0, 1]]
    # a ban at the second position only (min_tokens reached after the draft, say)
    greedy = SamplingParams(temperature=0)
    emitted, _ = verify(Sampler(0, CPU), torch.stack([LOGITS, LOGITS]),
                        [spec_row(greedy, [0], bans=[[0, 1]])])
    assert emitted == [[0, 2]]


def test_logprobs_are_those_of_the_emitted_tokens():
    params = SamplingParams(temperature=0, logprobs=2)
    emitted, lps = verify(Sampler(0, CPU), torch.stack([LOGITS, SECOND, LOGITS]),
                          [spec_row(params, [0, 1])])
    assert emitted == [[0, 5]]  # 1 rejected at SECOND
    raw = [LOGITS.log_softmax(0), SECOND.log_softmax(0)]
    assert len(lps[0].token_ids) == 2
    for j, token in enumerate(emitted[0]):
        assert lps[0].token_ids[j][0] == token
        assert lps[0].logprobs[j][0] == pytest.approx(float(raw[j][token]), abs=1e-6)
        assert len(lps[0].token_ids[j]) == 3  # the token and the top 2


def sampled_draft_rows(q: torch.Tensor, n: int, with_q: bool) -> list:
    """n rows, each with one draft drawn from q (passed along as its distribution or not)."""
    drafts = torch.multinomial(q, n, replacement=True,
                               generator=torch.Generator().manual_seed(7)).tolist()
    params = SamplingParams(temperature=1.0)
    return [dataclasses.replace(spec_row(params, [d], str(i)),
                                spec_draft_probs=q[None].float() if with_q else None)
            for i, d in enumerate(drafts)]


def test_drafts_sampled_from_a_distribution_follow_the_target():
    """A draft model's drafts, sampled from its own q: accepted with min(1, p/q), else the
    residual max(0, p - q); every emitted token follows p, and the acceptance rate is
    sum(min(p, q)), as the theory says. Verified as if chosen outright (one-hot q) they are
    exact too, but accepted less often (sum(p q)); drawing from p instead of the residual
    after a rejection is caught."""
    n = 20000
    p = expected(1.0)
    q = torch.softmax(torch.tensor([0.0, 2.0, 0.5, 1.0, -1.0, 0.0], dtype=torch.float64), 0)
    logits = torch.stack([LOGITS, SECOND]).repeat(n, 1)
    emitted, _ = verify(Sampler(1234, CPU), logits, sampled_draft_rows(q, n, with_q=True))
    assert_follows(torch.tensor([e[0] for e in emitted]), p)
    accepted = [e for e in emitted if len(e) == 2]
    rate, expected_rate = len(accepted) / n, float(torch.minimum(p, q).sum())
    assert abs(rate - expected_rate) < 4 * (expected_rate * (1 - expected_rate) / n) ** 0.5
    assert_follows(torch.tensor([e[1] for e in accepted]), torch.softmax(SECOND.double(), 0))
    one_hot, _ = verify(Sampler(1234, CPU), logits, sampled_draft_rows(q, n, with_q=False))
    assert_follows(torch.tensor([e[0] for e in one_hot]), p)
    one_hot_rate = sum(len(e) == 2 for e in one_hot) / n
    assert abs(one_hot_rate - float((p * q).sum())) < 0.015 and one_hot_rate < rate - 0.05
    g = torch.Generator().manual_seed(1)
    drafts = torch.multinomial(q, n, replacement=True, generator=g)
    accept = torch.rand(n, generator=g, dtype=torch.float64) < (p / q)[drafts]
    from_p = torch.multinomial(p, n, replacement=True, generator=g)
    with pytest.raises(AssertionError, match="chi2"):
        assert_follows(torch.where(accept, drafts, from_p), p)
