"""SuffixProposer (suffix decoding): drafts follow the continuation most occurrences of the
longest matched suffix share, in the request's own tokens and in earlier requests' outputs;
the draft stops at min_token_prob, at max_spec_factor x the match length and at k; ties go to
the most recent occurrence; the output cache keeps only the last max_cached_requests."""

from __future__ import annotations

from tokenmill.spec_decode import SpeculativeConfig, SuffixProposer, make_proposer


def test_own_tokens_continue_like_prompt_lookup():
    p = SuffixProposer(k=3)
    assert p.propose_with_match([1, 2, 3, 4, 5, 6, 9, 1, 2, 3]) == ([4, 5, 6], 3)
    assert p.propose_with_match([8, 8, 8, 8]) == ([8, 8, 8], 3)  # runs into the suffix itself
    assert p.propose_with_match([1, 2, 3]) == ([], 0)  # nothing earlier to match


def test_the_most_frequent_continuation_wins_and_rare_ones_stop_the_draft():
    # "7 8" occurs three times before the end: followed by 1 1 (twice) and by 2 (once)
    tokens = [7, 8, 1, 1, 0, 7, 8, 2, 0, 7, 8, 1, 1, 0, 5, 7, 8]
    assert SuffixProposer(k=3).propose_with_match(tokens) == ([1, 1], 2)  # 2 x factor 1.0
    assert SuffixProposer(k=3, min_token_prob=0.7).propose_with_match(tokens) == ([], 0)
    # the longest match decides: "5 7 8" occurs once more, followed by 2
    tokens = [5, 7, 8, 2, 0] + tokens
    assert SuffixProposer(k=2).propose_with_match(tokens) == ([2, 0], 3)


def test_draft_length_follows_the_match_length():
    tokens = [4, 1, 2, 3, 9, 4]  # only "4" matches
    assert SuffixProposer(k=3).propose_with_match(tokens) == ([1], 1)
    assert SuffixProposer(k=3, max_spec_factor=2.0).propose_with_match(tokens) == ([1, 2], 1)
    assert SuffixProposer(k=3, max_tree_depth=1).propose_with_match(
        [1, 2, 3, 9, 2, 3]) == ([9], 1)  # the depth caps the pattern


def test_ties_go_to_the_most_recent_occurrence():
    assert SuffixProposer(k=1).propose_with_match([3, 5, 0, 3, 6, 0, 3])[0] == [6]
    assert SuffixProposer(k=1).propose_with_match([3, 6, 0, 3, 5, 0, 3])[0] == [5]


def test_earlier_outputs_are_drafted_from_and_forgotten_past_the_cap():
    p = SuffixProposer(k=3, max_cached_requests=2)
    answer = [40, 41, 42, 43, 44]
    p.observe_output("a", answer)
    prompt = [9, 9, 40, 41]  # "40 41" appears only in the earlier output
    assert p.propose_with_match(prompt) == ([42, 43], 2)
    assert make_proposer(SpeculativeConfig(method="ngram")).propose(prompt) == []
    # the request's own tokens compete: the draft with more expected tokens wins
    own = [40, 41, 7, 7, 7, 1, 40, 41]
    assert p.propose_with_match(own) == ([7, 7], 2)
    p.observe_output("b", [1, 2])
    p.observe_output("c", [3, 4])  # "a" is forgotten
    assert p.propose_with_match(prompt) == ([], 0)
    p.observe_output("d", [])  # nothing to keep
    assert list(p._outputs) == ["b", "c"]


def test_outputs_end_where_they_ended():
    p = SuffixProposer(k=3)
    p.observe_output("a", [5, 6, 7])
    p.observe_output("b", [8, 9])
    # the match "7" is the end of output a: nothing continues it (not b's first token)
    assert p.propose_with_match([1, 7]) == ([], 0)
    assert p.propose_with_match([1, 5]) == ([6], 1)
