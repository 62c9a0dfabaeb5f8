"""Input batch layout (slot mapping, block tables) and block copies; the attention math of both
backends is tested in test_paged_backends.py."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from tests.attention.test_paged_backends import dense_reference
from tokenmill.attention.base import AttentionVariant
from tokenmill.attention.input_batch import InputBatch
from tokenmill.attention.kv_cache import allocate_kv_cache
from tokenmill.attention.torch_ref import TorchPagedAttention
from tokenmill.core.interface import ScheduledRequest
from tokenmill.sampling_params import SamplingParams

BS, HQ, HKV, D = 4, 6, 2, 8


def test_slot_mapping_follows_block_table():
    reqs = [
        ScheduledRequest("a", [1, 2, 3], 6, [7, 3, 9], True, SamplingParams()),
        ScheduledRequest("b", [4], 0, [5], True, SamplingParams()),
    ]
    batch = InputBatch.build(reqs, 4, torch.device("cpu"))
    # a: positions 6, 7, 8 → block 3 offsets 2, 3 then block 9 offset 0; b: block 5 offset 0
    assert batch.positions.tolist() == [6, 7, 8, 0]
    assert batch.slot_mapping.tolist() == [3 * 4 + 2, 3 * 4 + 3, 9 * 4, 5 * 4]
    assert batch.logits_indices.tolist() == [2, 3]
    assert batch.block_tables.tolist() == [[7, 3, 9], [5, 0, 0]]


def test_copy_blocks_copies_every_layer():
    from tokenmill.attention.kv_cache import copy_blocks

    cache = torch.randn(3, 2, 6, BS, HKV, D)
    before = cache.clone()
    copy_blocks(cache, [(2, 5), (1, 4)])
    torch.testing.assert_close(cache[:, :, 5], before[:, :, 2], rtol=0, atol=0)
    torch.testing.assert_close(cache[:, :, 4], before[:, :, 1], rtol=0, atol=0)
    torch.testing.assert_close(cache[:, :, :4], before[:, :, :4], rtol=0, atol=0)


def test_cascade_decode_over_a_shared_prefix_matches_dense():
    """Decode rows sharing their leading blocks (a cached prefix) take the cascade path."""
    torch.manual_seed(3)
    num_blocks = 60
    cache = allocate_kv_cache(1, num_blocks, BS, HKV, D, torch.float32, torch.device("cpu"))[0]
    backend = TorchPagedAttention(BS, torch.device("cpu"))
    shared = [7, 3, 11, 20, 5]  # 5 blocks = 20 tokens shared by every row
    lens = [30, 29, 25, 31, 27, 26]  # one length group of 6
    flat = cache.view(2, -1, HKV, D)
    free = [b for b in range(1, num_blocks) if b not in shared]
    reqs, full_k, full_v = [], [], []
    shared_k, shared_v = torch.randn(20, HKV, D), torch.randn(20, HKV, D)
    for pos in range(20):
        slot = shared[pos // BS] * BS + pos % BS
        flat[0, slot], flat[1, slot] = shared_k[pos], shared_v[pos]
    for i, n in enumerate(lens):
        blocks = shared + [free.pop() for _ in range(-(-n // BS) - len(shared))]
        k = torch.cat([shared_k, torch.randn(n - 20, HKV, D)])
        v = torch.cat([shared_v, torch.randn(n - 20, HKV, D)])
        for pos in range(20, n - 1):
            slot = blocks[pos // BS] * BS + pos % BS
            flat[0, slot], flat[1, slot] = k[pos], v[pos]
        full_k.append(k)
        full_v.append(v)
        reqs.append(ScheduledRequest(str(i), [0], n - 1, blocks, True,
                                     SamplingParams()))
    batch = InputBatch.build(reqs, BS, torch.device("cpu"))
    meta = backend.build_metadata(batch)
    assert [g.shared_block_ids.tolist() for g in meta.decode_groups
            if g.shared_block_ids is not None] != []
    q = torch.randn(len(lens), HQ, D)
    layer = SimpleNamespace(variant=AttentionVariant(D ** -0.5), kv_scales=None)
    out = backend.forward(layer, q, torch.stack([k[-1] for k in full_k]),
                          torch.stack([v[-1] for v in full_v]), cache, meta).view(-1, HQ, D)
    for i in range(len(lens)):
        ref = dense_reference(q[i:i + 1], full_k[i], full_v[i], D ** -0.5)
        torch.testing.assert_close(out[i:i + 1], ref, atol=1e-5, rtol=1e-5)
