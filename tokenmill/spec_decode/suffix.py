"""SuffixProposer: suffix decoding (SuffixDecoding, arXiv 2411.04975; vLLM's method "suffix").

A request's pattern is its last `max_tree_depth` tokens. Two sources can continue it: the
request's own tokens (prompt and output so far) and the outputs of the last
`max_cached_requests` finished requests (agentic loops and templated answers repeat across
requests, which n-gram lookup in one request cannot see). In each source, the occurrences of
the longest suffix of the pattern that occurs there (the current end excluded) form a
frequency tree: the draft follows, token by token, the continuation most of those occurrences
share; a token's probability is the share of the occurrences still following the draft that
continue with it. The draft stops where that share falls below `min_token_prob`, after
`max_spec_factor` x the match length (short matches draft little), or at k. Of the two
sources, the draft with the higher expected number of accepted tokens (the sum over its
positions of the product of the shares so far) is proposed.

This is the walk a suffix tree of depth `max_tree_depth` with occurrence counts gives; it is
computed here by a vectorised scan of the tokens instead of a kept tree (nothing to build or
update per token, no memory per request), so a query costs one pass over the request's tokens
(as n-gram lookup does) and one over the cached outputs: hence a default cache of 1000
outputs (vLLM's C++ tree keeps 10000). The scheduler drafts only in small batches, so at most
a few queries run per step.

Invariant: only verified tokens are ever looked at (the request's token list, and the outputs
of finished requests).
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np

_END = -1  # separates cached outputs: an occurrence reaching it has no continuation


class SuffixProposer:
    def __init__(self, k: int, max_tree_depth: int = 24, max_cached_requests: int = 1000,
                 max_spec_factor: float = 1.0, min_token_prob: float = 0.1) -> None:
        self.k, self.max_depth = k, max_tree_depth
        self.max_cached, self.max_spec_factor = max_cached_requests, max_spec_factor
        self.min_token_prob = min_token_prob
        self._outputs: OrderedDict[str, np.ndarray] = OrderedDict()  # request id → output
        self._cache: np.ndarray | None = np.full(1, _END, dtype=np.int64)

    # ---- the cross-request cache ------------------------------------------------------------
    # A match at least this long is one to draft on even at a low running acceptance.
    confident_match = 4

    def observe_output(self, req_id: str, output_token_ids: list[int]) -> None:
        """Remember a finished request's output (the oldest is forgotten past the cap)."""
        if self.max_cached <= 0 or not output_token_ids:
            return
        self._outputs[req_id] = np.asarray(output_token_ids, dtype=np.int64)
        self._outputs.move_to_end(req_id)
        while len(self._outputs) > self.max_cached:
            self._outputs.popitem(last=False)
        self._cache = None  # rebuilt at the next query

    def clear(self) -> None:
        """Forget every cached output."""
        self._outputs.clear()
        self._cache = None

    def _cached_tokens(self) -> np.ndarray:
        """The cached outputs, each followed by _END, in one array."""
        if self._cache is None:
            end = np.full(1, _END, dtype=np.int64)
            self._cache = np.concatenate([end] + [a for o in self._outputs.values()
                                                  for a in (o, end)])
        return self._cache

    # ---- proposing --------------------------------------------------------------------------
    def propose_with_match(self, token_ids: list[int], k: int | None = None
                           ) -> tuple[list[int], int]:
        """(up to k tokens continuing `token_ids`, the length of the suffix the chosen draft
        matched; 0: no draft)."""
        k = self.k if k is None else k
        tokens = np.asarray(token_ids, dtype=np.int64)
        pattern = tokens[-self.max_depth:]
        if k <= 0 or len(pattern) == 0:
            return [], 0
        own = _draft(tokens, len(tokens), pattern, k, self.max_spec_factor,
                     self.min_token_prob, extend=True)
        cached = self._cached_tokens()
        other = _draft(cached, len(cached), pattern, k, self.max_spec_factor,
                       self.min_token_prob)
        best = max(own, other, key=lambda d: d[1])
        return best[0], best[2] if best[0] else 0


def _draft(buf: np.ndarray, num_ends: int, pattern: np.ndarray, k: int, max_spec_factor: float,
           min_token_prob: float, extend: bool = False) -> tuple[list[int], float, int]:
    """(draft, expected accepted tokens, match length) from the occurrences in `buf` of the
    longest suffix of `pattern` occurring in `buf` with an end e < num_ends (the occurrence
    is buf[e - m:e], and buf[e] continues it). `extend`: `pattern` ends `buf`, so the draft
    continues `buf` and an occurrence may run on into it (as in "8 8 8 8" → "8 8 8")."""
    ends = np.flatnonzero(buf[:max(num_ends - 1, 0)] == pattern[-1]) + 1  # (C,) candidates
    if len(ends) == 0:
        return [], 0.0, 0
    lengths = np.ones(len(ends), dtype=np.int64)
    alive = np.ones(len(ends), dtype=bool)
    for j in range(1, len(pattern)):  # extend every candidate's match backwards
        pos = ends - 1 - j
        ok = alive & (pos >= 0)
        ok[ok] = buf[pos[ok]] == pattern[-1 - j]
        lengths += ok
        alive = ok
        if not alive.any():
            break
    match = int(lengths.max())
    cur = ends[lengths == match]  # where each occurrence of the longest match continues
    max_len = min(k, int(max_spec_factor * match))
    draft: list[int] = []
    prefix_prob, expected = 1.0, 0.0
    while len(draft) < max_len and len(cur):
        nxt = buf[cur]  # (C,) the token after each occurrence (_END: none)
        ids, counts = np.unique(nxt[nxt != _END], return_counts=True)
        if len(ids) == 0:
            break
        best = counts.max()
        tied = ids[counts == best]
        # ties: the token of the most recent occurrence
        token = int(tied[0]) if len(tied) == 1 else int(nxt[np.isin(nxt, tied)][-1])
        share = best / len(cur)
        if share < min_token_prob:
            break
        prefix_prob *= share
        expected += prefix_prob
        draft.append(token)
        if extend:
            buf = np.append(buf, token)
        cur = cur[nxt == token] + 1
        cur = cur[cur < len(buf)]
    return draft, expected, match
