"""The n-gram proposer (prompt lookup) and the speculative config's validation."""

from __future__ import annotations

import pytest

from tokenmill.spec_decode import NgramProposer, SpeculativeConfig


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
    with pytest.raises(ValueError, match="not built yet.*supported: ngram"):
        SpeculativeConfig.parse({"method": "draft_model"})
    with pytest.raises(ValueError, match="'medusa'; supported: ngram"):
        SpeculativeConfig.parse({"method": "medusa"})
    with pytest.raises(ValueError, match="num_speculative_tokens must be an integer in 1..3"):
        SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 8})
    with pytest.raises(ValueError, match="prompt_lookup_min <= prompt_lookup_max"):
        SpeculativeConfig.parse({"method": "ngram", "prompt_lookup_min": 5})
    with pytest.raises(ValueError, match="unknown speculative_config field.*model"):
        SpeculativeConfig.parse({"method": "ngram", "model": "x"})
    with pytest.raises(ValueError, match="not valid JSON"):
        SpeculativeConfig.parse("{method: ngram}")
