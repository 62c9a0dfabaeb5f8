"""DraftModelProposer on its own: the draft model's config is checked against the target at
start-up, and drafts made from the K/V it kept across steps (accepted drafts reused, rejected
ones overwritten) equal drafts made by a fresh draft model from the whole token list."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from tokenmill.attention import get_attention_backend
from tokenmill.config_model import model_config
from tokenmill.core.interface import ScheduledRequest
from tokenmill.engine_args import engine_config
from tokenmill.sampling_params import SamplingParams
from tokenmill.spec_decode.draft_model import DraftModelProposer

BLOCK = 8


def make_proposer(path: str) -> DraftModelProposer:
    config = model_config(path, max_model_len=256)
    backend = get_attention_backend("auto", BLOCK, torch.device("cpu"), config.dtype)
    return DraftModelProposer(config, num_blocks=64, block_size=BLOCK,
                              device=torch.device("cpu"), backend=backend)


def propose(proposer: DraftModelProposer, req_id: str, blocks: list[int], tokens: list[int],
            new: list[int], k: int, params: SamplingParams | None = None
            ) -> tuple[dict[str, list[int]], dict[str, torch.Tensor]]:
    """The proposer's drafts (and q's) after a step that emitted `new` after `tokens`."""
    r = ScheduledRequest(req_id=req_id, token_ids=[tokens[-1]], start_pos=len(tokens) - 1,
                         block_ids=blocks, sample=True,
                         sampling_params=params or SamplingParams(temperature=0),
                         prompt_token_ids=tokens, output_token_ids=[],
                         num_lookahead_tokens=k)
    return proposer.propose([r], [new])


def step(proposer: DraftModelProposer, req_id: str, blocks: list[int], tokens: list[int],
         new: list[int], k: int) -> list[int]:
    """The proposer's drafts after a step that emitted `new` after `tokens`."""
    return propose(proposer, req_id, blocks, tokens, new, k)[0][req_id]


def test_drafts_from_kept_kv_equal_drafts_from_scratch(tiny_model):
    path, _ = tiny_model("llama")
    kept, fresh = make_proposer(path), make_proposer(path)
    blocks = list(range(1, 33))  # 256 slots
    tokens = [5 + (7 * i) % 300 for i in range(21)]
    drafts = step(kept, "a", blocks, tokens[:-1], tokens[-1:], 3)
    assert len(drafts) == 3
    # all accepted + bonus, some accepted + a different token, none accepted, and a step
    # whose drafts were not scheduled (the request decoded plainly in between)
    for new in (lambda d: d + [11], lambda d: d[:1] + [d[1] + 1], lambda d: [d[0] + 1],
                lambda d: [d[0] + 1, d[1], d[2]], lambda d: [17, 19]):
        emitted = new(drafts)
        drafts = step(kept, "a", blocks, tokens, emitted, 3)
        tokens = tokens + emitted
        fresh.forget(["a"])
        assert drafts == step(fresh, "a", blocks, tokens[:-len(emitted)], emitted, 3)
    # one request's state never leaks into another's (its own block table)
    assert step(kept, "b", list(range(33, 64)), tokens[:-1], tokens[-1:], 2) == drafts[:2]


def test_draft_config_must_fit_the_target(tiny_model, tmp_path):
    path, _ = tiny_model("llama")
    other, _ = tiny_model("llama-mqa-llama3rope")
    config = engine_config(path, speculative_config={"method": "draft_model",
                                                           "model": other})
    assert config.draft_model.path == other and config.draft_model.max_model_len == 512
    self_draft = engine_config(path, speculative_config={"method": "draft_model",
                                                               "quantization": "int8"})
    assert (self_draft.draft_model.path, self_draft.draft_model.quantization) == (path, "int8")
    with pytest.raises(ValueError, match="is the target itself"):
        engine_config(path, speculative_config={"method": "draft_model", "model": path})
    small_vocab = tmp_path / "small-vocab"
    shutil.copytree(path, small_vocab)
    cfg = json.loads((small_vocab / "config.json").read_text())
    (small_vocab / "config.json").write_text(json.dumps(cfg | {"vocab_size": 1000}))
    with pytest.raises(ValueError, match="vocabulary of 1000 tokens, the target 49152"):
        engine_config(path, speculative_config={"method": "draft_model",
                                                      "model": str(small_vocab)})
    with pytest.raises(ValueError, match="speculative draft model: model path .* not exist"):
        engine_config(path, speculative_config={
            "method": "draft_model", "model": os.path.join(tmp_path, "missing")})
    with pytest.raises(ValueError, match="speculative draft model: unknown quantization"):
        engine_config(path, speculative_config={"method": "draft_model",
                                                      "quantization": "fp3"})


def test_sampled_requests_draw_drafts_from_q_and_pass_it_on(tiny_model):
    """A sampled request's drafts are draws from q (its temperature and top-k applied to the
    draft's logits), q goes along for the rejection rule; seeded requests draw the same
    drafts every time; greedy requests' drafts are one-hot (no q)."""
    path, _ = tiny_model("llama")
    tokens = [5 + (7 * i) % 300 for i in range(21)]
    params = SamplingParams(temperature=1.5, top_k=40, seed=3)

    def sampled(seed_params: SamplingParams) -> tuple[list[int], torch.Tensor]:
        drafts, probs = propose(make_proposer(path), "s", list(range(1, 33)), tokens[:-1],
                                tokens[-1:], 3, seed_params)
        return drafts["s"], probs["s"]

    drafts, q = sampled(params)
    assert q.shape == (3, 49152)
    torch.testing.assert_close(q.sum(-1), torch.ones(3))
    assert ((q > 0).sum(-1) <= 40).all()  # top-k applied
    assert all(q[j, d] > 0 for j, d in enumerate(drafts))
    assert sampled(params)[0] == drafts  # seeded: reproducible
    draws = {tuple(sampled(SamplingParams(temperature=1.5, top_k=40, seed=s))[0])
             for s in range(6)}
    assert len(draws) > 1  # really drawn, not the argmax
    drafts, probs = propose(make_proposer(path), "g", list(range(1, 33)), tokens[:-1],
                            tokens[-1:], 3)
    assert len(drafts["g"]) == 3 and probs == {}
