"""InputBatch: exact tensors for a decode step (the list path) and a mixed step (tensor ops)."""

from __future__ import annotations

import pytest
import torch

from tokenmill.attention.input_batch import InputBatch
from tokenmill.core.interface import ScheduledRequest
from tokenmill.sampling_params import SamplingParams


def build(*specs: tuple[list[int], int, list[int], bool]) -> InputBatch:
    reqs = [ScheduledRequest(str(i), tokens, start, blocks, sample, SamplingParams())
            for i, (tokens, start, blocks, sample) in enumerate(specs)]
    return InputBatch.build(reqs, 16, torch.device("cpu"))


def test_decode_step():
    b = build(([11], 20, [7, 3], True), ([12], 5, [9], False), ([13], 0, [4], True))
    assert b.input_ids.tolist() == [11, 12, 13]
    assert b.positions.tolist() == [20, 5, 0]
    assert b.slot_mapping.tolist() == [3 * 16 + 4, 9 * 16 + 5, 4 * 16]
    assert b.block_tables.tolist() == [[7, 3], [9, 0], [4, 0]]
    assert b.query_start_loc.tolist() == [0, 1, 2, 3]
    assert b.seq_lens_t.tolist() == [21, 6, 1] == b.seq_lens
    assert b.logits_indices.tolist() == [0, 2] and b.sample_rows == [0, 2]
    assert b.num_tokens == 3
    assert all(t.dtype == torch.long for t in (b.input_ids, b.positions, b.slot_mapping,
                                               b.logits_indices))


def test_mixed_step():
    b = build(([1, 2, 3], 14, [7, 3], True), ([12], 5, [9], True), ([4, 5], 0, [6], False))
    assert b.input_ids.tolist() == [1, 2, 3, 12, 4, 5]
    assert b.positions.tolist() == [14, 15, 16, 5, 0, 1]
    assert b.slot_mapping.tolist() == [7 * 16 + 14, 7 * 16 + 15, 3 * 16, 9 * 16 + 5,
                                       6 * 16, 6 * 16 + 1]
    assert b.query_start_loc.tolist() == [0, 3, 4, 6]
    assert b.seq_lens == [17, 6, 2]
    assert b.logits_indices.tolist() == [2, 3]


@pytest.mark.parametrize("device", ["cpu"] + (["cuda"] if torch.cuda.is_available() else []))
def test_host_lists_and_tensors_reach_the_device_as_they_are(device):
    """to_device (one transfer for several tensors) and tensor_on (a list): on CUDA through
    pinned memory without blocking the host; the same values, dtypes and shapes anywhere."""
    from tokenmill.attention.input_batch import tensor_on, to_device

    device = torch.device(device)
    got = tensor_on([1.5, 2.0, -3.25], device, torch.float32)
    assert got.device.type == device.type and got.dtype == torch.float32
    assert got.tolist() == [1.5, 2.0, -3.25]
    assert tensor_on([True, False], device).tolist() == [True, False]
    assert tensor_on([], device, torch.long).shape == (0,)
    a, b = torch.arange(6).view(2, 3), torch.tensor([7, 8])
    moved = to_device([a, b], device)
    assert [t.shape for t in moved] == [(2, 3), (2,)]
    assert moved[0].tolist() == a.tolist() and moved[1].tolist() == b.tolist()
