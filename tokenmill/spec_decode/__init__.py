"""Speculative decoding: proposers that draft tokens for a request, and their configuration.

The scheduler asks the proposer for up to k draft tokens of each decoding request
(`Request.spec_token_ids`), schedules them after the request's last token, and the runner
verifies them in the same forward pass (layers/rejection_sampler.py): the output is distributed
exactly as without speculation; greedy output is the same tokens.
"""

from tokenmill.spec_decode.config import SpeculativeConfig
from tokenmill.spec_decode.ngram import NgramProposer

__all__ = ["NgramProposer", "SpeculativeConfig"]
