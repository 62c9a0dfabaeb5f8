"""NgramProposer: prompt lookup decoding. The last n tokens of a request (n from
prompt_lookup_max down to prompt_lookup_min) are searched for earlier in its prompt and
output; the tokens that followed their most recent earlier occurrence are the draft.

Needs no model and costs one vectorised scan of the request's tokens per step; it drafts only
on a match, so open-ended text mostly gets no draft (and no verify cost).
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


class NgramProposer:
    def __init__(self, k: int, min_n: int, max_n: int) -> None:
        self.k, self.min_n, self.max_n = k, min_n, max_n
        # a match as long as it looks for is one to draft on even at a low acceptance
        self.confident_match = max_n

    def observe_output(self, req_id: str, output_token_ids: list[int]) -> None:
        """A finished request's output: lookup reads only a request's own tokens, so none."""

    def propose(self, token_ids: list[int], k: int | None = None) -> list[int]:
        """Up to k tokens continuing `token_ids` (empty: no match)."""
        return self.propose_with_match(token_ids, k)[0]

    def propose_with_match(self, token_ids: list[int], k: int | None = None
                           ) -> tuple[list[int], int]:
        """(up to k tokens continuing `token_ids`, the length of the suffix matched; 0: none)."""
        k = self.k if k is None else k
        tokens = np.asarray(token_ids, dtype=np.int64)
        L = len(tokens)
        for n in range(min(self.max_n, L - 1), self.min_n - 1, -1):
            # windows starting at 0 .. L - n - 1: every earlier occurrence, the suffix excluded
            windows = sliding_window_view(tokens[:L - 1], n)  # (L - n, n)
            hits = np.flatnonzero((windows == tokens[L - n:]).all(axis=1))
            if hits.size:
                start = int(hits[-1]) + n  # the most recent occurrence's continuation
                return tokens[start:start + k].tolist(), n
        return [], 0
