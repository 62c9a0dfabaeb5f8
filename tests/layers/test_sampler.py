"""Sampler: greedy; the distribution after temperature / top-k / top-p / min-p (chi-square over
20k draws, thresholds tight enough that an off-by-one in a mask fails); penalties, logit_bias and
min_tokens bans against hand-computed logits; seeded rows independent of the batch; logprobs."""

from __future__ import annotations

import math

import pytest
import torch

from tokenmill.core.interface import ScheduledRequest
from tokenmill.layers.sampler import Sampler, lists_of
from tokenmill.layers.sampling_batch import SamplingBatch
from tokenmill.sampling_params import SamplingParams

LOGITS = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])
# Chi-square critical values at p = 0.001 by degrees of freedom (scipy.stats.chi2.ppf(0.999, df)).
CHI2_CRIT = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52}
CPU = torch.device("cpu")


def row(params: SamplingParams, req_id: str = "r", prompt=(), output=(), banned=()):
    return ScheduledRequest(req_id, [0], 0, [1], True, params, list(prompt), list(output),
                            list(banned))


def draw(params: SamplingParams, n: int = 20000) -> torch.Tensor:
    logits = LOGITS.expand(n, -1).clone()
    sampled, _ = Sampler(1234, CPU)(logits, [row(params, str(i)) for i in range(n)])
    return sampled


def expected(temperature: float, top_k: int = 0, top_p: float = 1.0,
             min_p: float = 0.0) -> torch.Tensor:
    """The target distribution computed the slow, obvious way."""
    p = [math.exp(x / temperature) for x in LOGITS.tolist()]
    p = [x / sum(p) for x in p]
    keep = [x >= min_p * max(p) for x in p]
    order = sorted(range(len(p)), key=lambda i: -p[i])
    kept = [i for i in order if keep[i]]
    if top_k:
        kept = kept[:top_k]
    mass = sum(p[i] for i in kept)
    nucleus, acc = [], 0.0
    for i in kept:  # renormalized mass before the token must be below top_p
        if acc >= top_p:
            break
        nucleus.append(i)
        acc += p[i] / mass
    out = torch.zeros(len(p), dtype=torch.float64)
    for i in nucleus:
        out[i] = p[i]
    return out / out.sum()


def assert_follows(samples: torch.Tensor, probs: torch.Tensor) -> None:
    n = samples.numel()
    counts = torch.bincount(samples, minlength=probs.numel()).double()
    assert counts[probs == 0].sum() == 0, f"a masked token was sampled: {counts.tolist()}"
    support = probs > 0
    exp = probs[support] * n
    chi2 = float(((counts[support] - exp) ** 2 / exp).sum())
    df = int(support.sum()) - 1
    if df > 0:
        assert chi2 < CHI2_CRIT[df], f"chi2={chi2:.1f} over df={df}"


def test_greedy_is_argmax():
    logits = torch.randn(5, 100)
    out, lps = Sampler(0, CPU)(logits, [row(SamplingParams(temperature=0))] * 5)
    assert out.tolist() == logits.argmax(-1).tolist() and lps is None


@pytest.mark.parametrize("kwargs, support", [
    (dict(temperature=0.7), 6),
    (dict(temperature=1.5), 6),
    (dict(temperature=1.0, top_k=3), 3),
    (dict(temperature=1.0, top_p=0.8), 3),  # masses ≈ .56 .21 .12 …: the 3rd crosses 0.8
    (dict(temperature=1.0, min_p=0.1), 4),  # keeps p >= 0.056
    (dict(temperature=2.0, top_k=4, top_p=0.8, min_p=0.2), 3),
])
def test_sampled_distribution(kwargs, support):
    probs = expected(kwargs["temperature"], kwargs.get("top_k", 0), kwargs.get("top_p", 1.0),
                     kwargs.get("min_p", 0.0))
    assert int((probs > 0).sum()) == support  # the case tests the boundary it claims to
    assert_follows(draw(SamplingParams(**kwargs)), probs)


def test_off_by_one_mask_would_fail():
    """The chi-square threshold rejects the top-k=2 distribution when top-k=3 is drawn."""
    samples = draw(SamplingParams(temperature=1.0, top_k=3))
    with pytest.raises(AssertionError):
        assert_follows(samples, expected(1.0, top_k=2))
    wrong = expected(1.0, top_k=4)
    with pytest.raises(AssertionError):
        assert_follows(samples, wrong)


def test_penalties_match_hand_computation():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0]])
    params = SamplingParams(temperature=0, repetition_penalty=2.0, frequency_penalty=0.5,
                            presence_penalty=0.25)
    r = row(params, prompt=[0, 1], output=[3, 3, 2])
    got = SamplingBatch.build([r], 5, CPU).apply_penalties(logits.clone())
    # token 0: prompt only → 2.0 / 2;  token 1: prompt only, negative → -1.0 * 2
    # token 2: output once → 0.5 / 2 - 0.5 * 1 - 0.25;  token 3: output twice → 3 / 2 - 1 - .25
    # token 4: unseen → unchanged
    want = torch.tensor([[1.0, -2.0, 0.25 - 0.5 - 0.25, 1.5 - 1.0 - 0.25, -2.0]])
    torch.testing.assert_close(got, want)


def test_penalties_change_greedy_choice_per_row():
    logits = torch.tensor([[5.0, 4.9, 0.0], [5.0, 4.9, 0.0]])
    rows = [row(SamplingParams(temperature=0, frequency_penalty=1.0), "a", output=[0]),
            row(SamplingParams(temperature=0), "b", output=[0])]
    out, _ = Sampler(0, CPU)(logits, rows)
    assert out.tolist() == [1, 0]


def test_logit_bias_and_bans():
    logits = torch.tensor([[3.0, 1.0, 0.0, 2.0]])
    b = SamplingBatch.build([row(SamplingParams(logit_bias={1: 5.0, 3: -100}),
                                 banned=[0])], 4, CPU)
    got = b.apply_bias_and_bans(logits.clone())
    assert got.tolist() == [[float("-inf"), 6.0, 0.0, -98.0]]
    out, _ = Sampler(0, CPU)(logits, [row(SamplingParams(temperature=0, logit_bias={2: 10}))])
    assert out.tolist() == [2]


def test_seeded_rows_ignore_batch_composition():
    torch.manual_seed(0)
    logits = torch.randn(4, 1000)
    seeded = SamplingParams(temperature=1.0, seed=42)
    other = SamplingParams(temperature=0.9)
    alone = [int(Sampler(0, CPU)(logits[:1], [row(seeded, "x")])[0]) for _ in range(2)]
    mixed, _ = Sampler(7, CPU)(logits[[1, 0, 2]], [row(other, "y"), row(seeded, "x"),
                                                   row(other, "z")])
    assert alone[0] == alone[1] == int(mixed[1])


def test_logprobs_are_raw_log_softmax_with_ranks():
    torch.manual_seed(1)
    logits = torch.randn(2, 50)
    rows = [row(SamplingParams(temperature=0, logprobs=3, presence_penalty=1.0), "a",
                output=[int(logits[0].argmax())]),
            row(SamplingParams(temperature=0), "b")]
    out, tensors = Sampler(0, CPU)(logits, rows)
    (lps,) = lists_of([tensors])
    raw = logits.log_softmax(-1)
    chosen = int(out[0])
    assert chosen != int(logits[0].argmax())  # the penalty moved the choice ...
    assert lps.token_ids[0][0] == chosen  # ... and its logprob is the raw one, ranked 2nd
    assert lps.ranks[0][0] == 2
    assert lps.logprobs[0][0] == pytest.approx(float(raw[0, chosen]), abs=1e-6)
    top = raw[0].topk(3)
    assert lps.token_ids[0][1:] == top.indices.tolist()
    assert lps.logprobs[0][1:] == pytest.approx(top.values.tolist(), abs=1e-6)
    assert lps.ranks[0][1:] == [1, 2, 3]
