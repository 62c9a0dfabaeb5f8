"""Speculative decoding: proposers that draft tokens for a request, and their configuration.

The scheduler gets up to k draft tokens for each decoding request (`Request.spec_token_ids`),
schedules them after the request's last token, and the runner verifies them in the same
forward pass (layers/rejection_sampler.py): the output is distributed exactly as without
speculation; greedy output is the same tokens. Drafts come from a proposer the scheduler calls
at schedule time (ngram.py: lookup in the request's tokens; suffix.py: also in earlier
requests' outputs), or from a draft model the runner runs after each step (draft_model.py).
"""

from tokenmill.spec_decode.config import SpeculativeConfig
from tokenmill.spec_decode.ngram import NgramProposer
from tokenmill.spec_decode.suffix import SuffixProposer

__all__ = ["NgramProposer", "SpeculativeConfig", "SuffixProposer", "make_proposer"]


def make_proposer(config: SpeculativeConfig | None) -> NgramProposer | SuffixProposer | None:
    """The scheduler-side proposer of a config (None: none, or a draft model's, which runs in
    the model runner: spec_decode/draft_model.py)."""
    if config is None or config.method == "draft_model":
        return None
    k = config.num_speculative_tokens
    if config.method == "ngram":
        return NgramProposer(k, config.prompt_lookup_min, config.prompt_lookup_max)
    return SuffixProposer(k, config.suffix_decoding_max_tree_depth,
                          config.suffix_decoding_max_cached_requests,
                          config.suffix_decoding_max_spec_factor,
                          config.suffix_decoding_min_token_prob)
