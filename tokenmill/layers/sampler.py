"""Sampler: one vectorised pass turning a batch of logits into next tokens, each row with its own
parameters (greedy, temperature, top-k, top-p) and, when seeded, its own random generator.

Random draws use the exponential race: argmax(p / E) with E ~ Exp(1) i.i.d. picks index i with
probability p_i. The noise for a seeded request comes from that request's generator alone, so
its tokens do not depend on what else is in the batch. Masked tokens get probability 0 and can
never win the race.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tokenmill.sampling_params import SamplingParams


class Sampler:
    def __init__(self, seed: int, device: torch.device) -> None:
        self.device = device
        self._global = torch.Generator(device=device)
        self._global.manual_seed(seed)
        self._generators: dict[str, torch.Generator] = {}

    def forget(self, req_ids: set[str]) -> None:
        """Drop the generators of finished requests."""
        for r in req_ids:
            self._generators.pop(r, None)

    def _generator(self, req_id: str, seed: int) -> torch.Generator:
        g = self._generators.get(req_id)
        if g is None:
            g = torch.Generator(device=self.device)
            g.manual_seed(seed)
            self._generators[req_id] = g
        return g

    def __call__(self, logits: torch.Tensor, req_ids: Sequence[str],
                 params: Sequence[SamplingParams]) -> torch.Tensor:
        """logits (S, V) float → sampled token ids (S,) long."""
        greedy = [p.is_greedy for p in params]
        if all(greedy):
            return logits.argmax(dim=-1)
        logits = logits.float()
        temps = [1.0 if g else p.temperature for g, p in zip(greedy, params, strict=True)]
        temps = torch.tensor(temps, device=logits.device)
        probs = _apply_top_k_top_p(logits / temps[:, None], params).softmax(dim=-1)
        noise = self._exponential_noise(probs, req_ids, params, greedy)
        sampled = (probs / noise).argmax(dim=-1)
        if any(greedy):
            is_greedy = torch.tensor(greedy, device=logits.device)
            sampled = torch.where(is_greedy, logits.argmax(dim=-1), sampled)
        return sampled

    def _exponential_noise(self, probs: torch.Tensor, req_ids: Sequence[str],
                           params: Sequence[SamplingParams], greedy: list[bool]) -> torch.Tensor:
        noise = torch.empty_like(probs)
        seeded = [i for i, p in enumerate(params) if p.seed is not None and not greedy[i]]
        noise.exponential_(generator=self._global)
        for i in seeded:
            noise[i].exponential_(generator=self._generator(req_ids[i], params[i].seed))
        return noise


def _apply_top_k_top_p(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Set logits outside each row's top-k and top-p nucleus to -inf. logits (S, V)."""
    top_k = [p.top_k for p in params]
    top_p = [p.top_p for p in params]
    if not any(top_k) and all(p >= 1.0 for p in top_p):
        return logits
    vocab = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)  # (S, V)
    ranks = torch.arange(vocab, device=logits.device)
    k = torch.tensor([k if k > 0 else vocab for k in top_k], device=logits.device)
    remove = ranks[None, :] >= k[:, None]
    sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    # Keep a token when the mass strictly before it is below top_p (the first always stays).
    before = probs.cumsum(dim=-1) - probs
    p = torch.tensor(top_p, device=logits.device)
    sorted_logits = sorted_logits.masked_fill(before >= p[:, None], float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)
