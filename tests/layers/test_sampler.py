"""Sampler: greedy, distribution after temperature / top-k / top-p (chi-square over 20k draws),
and seeded rows that do not depend on the rest of the batch."""

from __future__ import annotations

import torch

from tokenmill.layers.sampler import Sampler
from tokenmill.sampling_params import SamplingParams

LOGITS = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])
# Chi-square critical values at p = 0.001 by degrees of freedom (scipy.stats.chi2.ppf(0.999, df)).
CHI2_CRIT = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52}


def draw(params: SamplingParams, n: int = 20000) -> torch.Tensor:
    sampler = Sampler(seed=1234, device=torch.device("cpu"))
    logits = LOGITS.expand(n, -1).clone()
    return sampler(logits, [str(i) for i in range(n)], [params] * n)


def expected(temperature: float, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    p = (LOGITS / temperature).softmax(-1)
    order = p.argsort(descending=True)
    keep = torch.zeros_like(p, dtype=torch.bool)
    mass = 0.0
    for rank, i in enumerate(order.tolist()):
        if (top_k and rank >= top_k) or mass >= top_p:
            break
        keep[i] = True
        mass += float(p[i])
    p = torch.where(keep, p, 0.0)
    return p / p.sum()


def assert_follows(samples: torch.Tensor, probs: torch.Tensor) -> None:
    n = samples.numel()
    counts = torch.bincount(samples, minlength=probs.numel()).double()
    assert counts[probs == 0].sum() == 0, "a masked token was sampled"
    support = probs > 0
    exp = probs[support].double() * n
    chi2 = float(((counts[support] - exp) ** 2 / exp).sum())
    df = int(support.sum()) - 1
    if df > 0:
        assert chi2 < CHI2_CRIT[df], f"chi2={chi2:.1f} over df={df}"


def test_greedy_is_argmax():
    sampler = Sampler(0, torch.device("cpu"))
    logits = torch.randn(5, 100)
    out = sampler(logits, list("abcde"), [SamplingParams(temperature=0)] * 5)
    assert out.tolist() == logits.argmax(-1).tolist()


def test_temperature_distribution():
    assert_follows(draw(SamplingParams(temperature=0.7)), expected(0.7))
    assert_follows(draw(SamplingParams(temperature=1.5)), expected(1.5))


def test_top_k_distribution():
    assert_follows(draw(SamplingParams(temperature=1.0, top_k=3)), expected(1.0, top_k=3))


def test_top_p_distribution():
    # softmax(LOGITS) ≈ [.56, .21, .12, .08, .03, .004]: top_p=0.8 keeps exactly 3 tokens
    probs = expected(1.0, top_p=0.8)
    assert int((probs > 0).sum()) == 3
    assert_follows(draw(SamplingParams(temperature=1.0, top_p=0.8)), probs)


def test_seeded_rows_ignore_batch_composition():
    torch.manual_seed(0)
    logits = torch.randn(4, 1000)
    seeded = SamplingParams(temperature=1.0, seed=42)
    other = SamplingParams(temperature=0.9)
    alone = [int(Sampler(0, torch.device("cpu"))(logits[:1], ["x"], [seeded]))
             for _ in range(2)]
    s = Sampler(7, torch.device("cpu"))
    mixed = s(logits[[1, 0, 2]], ["y", "x", "z"], [other, seeded, other])
    assert alone[0] == alone[1] == int(mixed[1])
