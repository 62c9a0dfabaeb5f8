"""The cascade planner both cascading backends use: sequences grouped by shared leading
blocks, the shared run cut to what every member has cached before its first query, and the
policy's thresholds (members, queries, blocks, a chunk's own work) applied."""

from __future__ import annotations

import torch

from tokenmill.attention.cascade import CascadePolicy, plan_cascades
from tokenmill.attention.input_batch import InputBatch
from tokenmill.core.interface import ScheduledRequest
from tokenmill.sampling_params import SamplingParams

BS = 4
PREFIX = [9, 4, 7, 12, 3]  # 5 shared blocks = 20 tokens


def batch_of(specs: list[tuple[list[int], int, int]]) -> InputBatch:
    """(block table, cached tokens, query tokens) per sequence."""
    reqs = [
        ScheduledRequest(str(i), [1] * n, cached, blocks, True, SamplingParams())
        for i, (blocks, cached, n) in enumerate(specs)]
    return InputBatch.build(reqs, BS, torch.device("cpu"))


def test_groups_by_shared_blocks_and_cuts_to_the_cached_part():
    batch = batch_of([
        (PREFIX + [20, 21], 26, 1),  # decodes at different lengths, same prefix
        (PREFIX + [22], 21, 1),
        (PREFIX[:4] + [30, 31], 19, 1),  # shares 4 blocks only (then diverges)
        ([40, 41, 42, 43, 44, 45], 22, 1),  # another prefix, alone
        (PREFIX + [23, 24], 20, 6),  # a chunk right after the prefix
    ])
    plans = plan_cascades(batch, BS, range(5), CascadePolicy(min_blocks=4, min_rows=2,
                                                             min_queries=2))
    assert [(c.rows, c.num_blocks) for c in plans] == [([0, 1, 2, 4], 4)]
    # without the diverging row, the others share all 5 blocks (row 4 has cached exactly 20)
    plans = plan_cascades(batch, BS, [0, 1, 4], CascadePolicy(min_blocks=4, min_rows=2,
                                                              min_queries=2))
    assert [(c.rows, c.num_blocks) for c in plans] == [([0, 1, 4], 5)]


def test_policy_thresholds():
    batch = batch_of([(PREFIX + [20], 21, 1), (PREFIX + [21], 22, 1),
                      (PREFIX + [22, 23, 24, 25], 20, 16)])
    rows = range(3)
    assert plan_cascades(batch, BS, rows, CascadePolicy(min_rows=4)) == []
    assert plan_cascades(batch, BS, rows, CascadePolicy(min_blocks=6)) == []
    assert plan_cascades(batch, BS, [0, 1], CascadePolicy(min_queries=3)) == []
    # the 16-token chunk's own work (16 x 20 pairs) is over the limit: it stays out
    plans = plan_cascades(batch, BS, rows, CascadePolicy(min_queries=2, max_own_pairs=100))
    assert [c.rows for c in plans] == [[0, 1]]
