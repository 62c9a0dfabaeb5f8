"""The n-gram proposer (prompt lookup), the draft-length policy and the speculative config's
validation."""

from __future__ import annotations

import pytest

from tokenmill.spec_decode import NgramProposer, SpeculativeConfig
from tokenmill.spec_decode.policy import (
    INITIAL_ACCEPTANCE,
    VERIFY_COST_PER_DRAFT,
    draft_length,
    update_acceptance,
)


def test_ngram_drafts_what_followed_the_latest_match():
    p = NgramProposer(k=3, min_n=2, max_n=3)
    #        0  1  2  3  4  5  6  7  8  9
    tokens = [5, 6, 7, 8, 9, 5, 6, 7, 1, 2, 5, 6, 7]
    assert p.propose(tokens) == [1, 2, 5]  # (5, 6, 7) last seen at 5: then 1, 2, 5
    assert p.propose(tokens, k=1) == [1]
    assert p.propose([1, 2, 3, 4]) == []  # no earlier occurrence of any suffix
    assert p.propose([3]) == []


def test_ngram_prefers_the_longest_suffix():
    p = NgramProposer(k=2, min_n=1, max_n=3)
    # (8, 9) occurs at 0 (then 4) and the 1-gram (9) later at 6 (then 7): the 2-gram wins
    assert p.propose([8, 9, 4, 4, 0, 0, 9, 7, 1, 8, 9]) == [4, 4]
    assert NgramProposer(k=2, min_n=1, max_n=1).propose([8, 9, 4, 4, 0, 0, 9, 7, 1, 8, 9]) == [7, 1]


def test_ngram_continuation_may_run_into_the_suffix():
    assert NgramProposer(k=3, min_n=2, max_n=2).propose([1, 1, 1]) == [1]  # a repeated token


def test_config_parses_vllm_json_and_refuses_what_it_cannot_do():
    cfg = SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 2, '
                                  '"prompt_lookup_max": 5, "prompt_lookup_min": 1}')
    assert (cfg.num_speculative_tokens, cfg.prompt_lookup_max, cfg.prompt_lookup_min) == (2, 5, 1)
    assert SpeculativeConfig.parse(None) is None
    assert SpeculativeConfig.parse({"method": "ngram"}) == SpeculativeConfig()
    with pytest.raises(ValueError, match="not built yet.*supported: ngram, suffix, draft_model"):
        SpeculativeConfig.parse({"method": "eagle"})
    suffix = SpeculativeConfig.parse({"method": "suffix", "suffix_decoding_max_tree_depth": 8,
                                      "suffix_decoding_min_token_prob": 0.5})
    assert (suffix.suffix_decoding_max_tree_depth, suffix.suffix_decoding_min_token_prob,
            suffix.suffix_decoding_max_cached_requests) == (8, 0.5, 1000)
    for field, bad in [("suffix_decoding_max_tree_depth", 0),
                       ("suffix_decoding_max_cached_requests", -1),
                       ("suffix_decoding_max_spec_factor", 0),
                       ("suffix_decoding_min_token_prob", 1.5)]:
        with pytest.raises(ValueError, match=field):
            SpeculativeConfig.parse({"method": "suffix", field: bad})
    with pytest.raises(ValueError, match="suffix_decoding_max_tree_depth do not apply to "
                                         "method 'ngram'"):
        SpeculativeConfig.parse({"method": "ngram", "suffix_decoding_max_tree_depth": 8})
    with pytest.raises(ValueError, match="needs a draft 'model', or a 'quantization'"):
        SpeculativeConfig.parse({"method": "draft_model"})
    with pytest.raises(ValueError, match="prompt_lookup_max do not apply to method "
                                         "'draft_model'; it reads model, quantization"):
        SpeculativeConfig.parse({"method": "draft_model", "model": "x", "prompt_lookup_max": 3})
    draft = SpeculativeConfig.parse({"method": "draft_model", "quantization": "gguf",
                                     "num_speculative_tokens": 2})
    assert (draft.model, draft.quantization, draft.num_speculative_tokens) == (None, "gguf", 2)
    with pytest.raises(ValueError, match="'medusa'; supported: ngram"):
        SpeculativeConfig.parse({"method": "medusa"})
    for k in range(1, 9):  # vLLM's range (it sets no upper bound)
        assert SpeculativeConfig.parse({"method": "ngram",
                                        "num_speculative_tokens": k}).num_speculative_tokens == k
    for bad in (0, 33, 2.0, True):
        with pytest.raises(ValueError, match="num_speculative_tokens must be an integer in "
                                             "1..32"):
            SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": bad})
    with pytest.raises(ValueError, match="prompt_lookup_min <= prompt_lookup_max"):
        SpeculativeConfig.parse({"method": "ngram", "prompt_lookup_min": 5})
    with pytest.raises(ValueError, match="model do not apply to method 'ngram'"):
        SpeculativeConfig.parse({"method": "ngram", "model": "x"})
    with pytest.raises(ValueError, match="unknown speculative_config field.*draft_tp"):
        SpeculativeConfig.parse({"method": "ngram", "draft_tp": 2})
    with pytest.raises(ValueError, match="takes no model or quantization"):
        SpeculativeConfig(method="ngram", quantization="int8")
    with pytest.raises(ValueError, match="not valid JSON"):
        SpeculativeConfig.parse("{method: ngram}")


def test_ngram_reports_the_length_of_its_match():
    p = NgramProposer(k=2, min_n=1, max_n=3)
    assert p.propose_with_match([8, 9, 4, 4, 0, 0, 9, 7, 1, 8, 9]) == ([4, 4], 2)
    assert p.propose_with_match([1, 2, 3]) == ([], 0)


def test_draft_length_follows_the_running_acceptance():
    assert draft_length(0.9, 3, long_match=False) == 3
    assert draft_length(0.5, 3, long_match=False) == 1
    assert draft_length(0.1, 3, long_match=False) == 0  # open-ended text: verify not worth it
    assert draft_length(0.1, 3, long_match=True) == 1  # a long match is probed
    assert draft_length(0.9, 0, long_match=True) == 0  # nothing proposed
    # the rule: expected tokens per unit of verify cost, against 1 for a plain step
    a, c = 0.6, VERIFY_COST_PER_DRAFT
    rates = [sum(a ** j for j in range(k + 1)) / (1 + c * k) for k in range(4)]
    assert draft_length(a, 3, False) == max(range(4), key=rates.__getitem__)


def test_acceptance_estimate_moves_toward_what_was_verified():
    a = INITIAL_ACCEPTANCE
    for _ in range(20):
        a = update_acceptance(a, 3, 3)  # all accepted
    assert a > 0.95
    for _ in range(20):
        a = update_acceptance(a, 0, 3)  # first rejected: one observation, a failure
    assert a < 0.05
    assert update_acceptance(0.5, 1, 3) == pytest.approx(0.5 + 0.2 * 0.5 - 0.2 * 0.6)
