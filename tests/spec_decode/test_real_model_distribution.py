"""Sampled output under speculation follows the real model's distribution: SmolLM2's next
tokens after forced draft tokens, through the model runner's verify step (the same path the
engine takes), chi-square against the model's own softmax at each position (top-6, so that
every category has enough expected counts), for a draft it usually accepts, one it usually
rejects and one it can never accept; and the bonus token after an accepted draft follows the
model's distribution given that draft."""

from __future__ import annotations

import pytest
import torch

from tests.layers.test_sampler import assert_follows
from tokenmill.attention.input_batch import InputBatch
from tokenmill.core.interface import (
    NewRequestData,
    RequestStep,
    ScheduledRequest,
    SchedulerOutput,
)
from tokenmill.engine.tokenizer import load_tokenizer
from tokenmill.engine_args import engine_config
from tokenmill.sampling_params import SamplingParams
from tokenmill.worker.model_runner import ModelRunner

N = 1000  # verifications per case (each a 2-token row: the suite's slowest test at 2000)
BATCH = 1000  # rows per step
TOP_K, TEMPERATURE = 6, 1.3


@pytest.fixture(scope="module")
def runner() -> ModelRunner:
    return ModelRunner(engine_config(None, max_model_len=64, num_kv_blocks=3,
                                           block_size=16))


def target(logits: torch.Tensor) -> torch.Tensor:
    """The distribution top-k and temperature make of one position's logits."""
    probs = torch.zeros(logits.numel(), dtype=torch.float64)
    top = logits.double().topk(TOP_K)
    probs[top.indices] = torch.softmax(top.values / TEMPERATURE, 0)
    return probs


def model_logits(runner: ModelRunner, tokens: list[int]) -> torch.Tensor:
    """The model's logits at every position of `tokens`, (L, V)."""
    row = ScheduledRequest("ref", tokens, 0, [2], True, SamplingParams(temperature=0))
    batch = InputBatch.build([row], runner.block_size, runner.device)
    with torch.inference_mode():
        hidden = runner.model(batch.input_ids, batch.positions,
                              runner.backend.build_metadata(batch))
        return runner.model.compute_logits(hidden, torch.arange(len(tokens)))


def verify_many(runner: ModelRunner, prompt: list[int], drafts: list[int]) -> list[list[int]]:
    """N verify steps of `drafts` after `prompt`: the prompt's K/V is computed once into block
    1, which every row then shares (they all write the same K/V for the same tokens)."""
    params = SamplingParams(temperature=TEMPERATURE, top_k=TOP_K)
    runner.execute(SchedulerOutput(
        scheduled=[RequestStep("prefill", 0, len(prompt) - 1, False)],
        new_requests=[NewRequestData("prefill", prompt, [], params, [1])]))
    emitted: list[list[int]] = []
    for start in range(0, N, BATCH):
        ids = [f"r{start + i}" for i in range(BATCH)]
        emitted += runner.execute(SchedulerOutput(
            scheduled=[RequestStep(rid, len(prompt) - 1, 1, True, spec_token_ids=drafts,
                                   spec_banned_token_ids=[[] for _ in drafts]) for rid in ids],
            new_requests=[NewRequestData(rid, prompt, [], params, [1]) for rid in ids]
        )).sampled_token_ids
    return emitted


@pytest.mark.slow
def test_emitted_tokens_follow_the_model_whatever_the_draft(runner):
    # a next token with many likely answers
    tok_ids = load_tokenizer(runner.config.model).encode("My favourite colour is")
    logits = model_logits(runner, tok_ids)
    first = target(logits[-1])
    ranked = first.argsort(descending=True).tolist()
    assert first[ranked[TOP_K - 1]] * N > 5, "pick a prompt with a flatter next token"
    likely, unlikely, impossible = ranked[0], ranked[TOP_K - 1], ranked[TOP_K + 10]
    for draft in (likely, unlikely, impossible):
        emitted = verify_many(runner, tok_ids, [draft])
        assert_follows(torch.tensor([e[0] for e in emitted]), first)
        accepted = [e for e in emitted if len(e) == 2]
        assert all(e[0] == draft for e in accepted)
        assert all(e[0] != draft for e in emitted if len(e) == 1)
        if draft == impossible:
            assert not accepted
        elif draft == likely:  # the bonus token follows the model given the draft
            assert len(accepted) > N * first[likely] * 0.8
            bonus = target(model_logits(runner, tok_ids + [draft])[-1])
            assert_follows(torch.tensor([e[1] for e in accepted]), bonus)
