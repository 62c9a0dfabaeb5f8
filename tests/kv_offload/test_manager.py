"""The scheduler's side of the KV tiers, on KVCacheManager without a model: evicted blocks are
saved under chained keys (namespaced by adapter), a later request's hit runs from the tree into
the host tier with load copies into its new blocks, host slots of a hit are never reused in the
same step, files are read into staging before a request starts, and a block whose file failed
its check is computed and never read again."""

from __future__ import annotations

from tokenmill.core.kv_cache_manager import KVCacheManager
from tokenmill.core.request import Request
from tokenmill.kv_offload.block_file import write_block
from tokenmill.kv_offload.block_hash import block_keys, chain_seed
from tokenmill.kv_offload.config import KVOffloadConfig
from tokenmill.kv_offload.manager import OffloadManager
from tokenmill.kv_offload.ops import OffloadResult
from tokenmill.lora.request import AdapterRef
from tokenmill.sampling_params import SamplingParams

BS = 4


def req(rid: str, tokens: list[int], lora_key: str | None = None) -> Request:
    lora = None if lora_key is None else AdapterRef("x", 1, "/nowhere", lora_key, 8)
    return Request(rid, tokens, SamplingParams(max_tokens=4), [2], 4, lora=lora)


def run(kv: KVCacheManager, r: Request):
    """Admit and compute the whole request, then end it; the step's offload ops."""
    hit = kv.get_computed_blocks(r)
    assert not hit.wait_for_kv
    assert kv.allocate_slots(r, r.num_tokens - hit.num_tokens, hit) is not None
    r.num_computed_tokens = r.num_tokens
    ops = kv.take_offload_ops()
    kv.free(r)
    kv.check_integrity()
    return hit, ops


def manager(num_blocks: int, host_blocks: int = 0, **config) -> KVCacheManager:
    offload = OffloadManager(KVOffloadConfig("model-a", 64, host_blocks=host_blocks, **config),
                             BS)
    return KVCacheManager(num_blocks, BS, enable_prefix_caching=True, offload=offload)


def test_keys_chain_the_prefix_and_the_adapter():
    seed = chain_seed("model-a", None)
    keys = block_keys(seed, list(range(12)), BS)
    assert len(keys) == 3 and len(set(keys)) == 3
    assert block_keys(seed, list(range(12)), BS, start=1) == keys[1:]
    assert block_keys(seed, [9, *range(1, 12)], BS)[1] != keys[1]  # another first block
    assert block_keys(chain_seed("model-a", "adapter"), list(range(12)), BS)[0] != keys[0]
    assert block_keys(chain_seed("model-b", None), list(range(12)), BS)[0] != keys[0]


def test_evicted_blocks_come_back_from_the_host_tier():
    kv = manager(num_blocks=6, host_blocks=8)  # 5 usable blocks: one prompt at a time
    a, b = list(range(100, 116)), list(range(200, 216))  # 4 blocks each
    run(kv, req("a", a))
    _, ops = run(kv, req("b", b))  # evicts a's blocks: saved to host slots
    assert len(ops.save_host) == 4  # a's full blocks, which the tree held
    hit, ops = run(kv, req("a2", a + [1, 2]))
    assert hit.num_tokens == 16 and hit.offloaded is not None
    assert [slot for slot, _ in ops.load] == hit.offloaded.slots  # copied into new blocks
    assert len(ops.save_host) == 4  # b's blocks made room and went down in turn
    assert set(s for _, s in ops.save_host).isdisjoint(hit.offloaded.slots)
    assert kv.offload.hit_tokens["cpu"] == 16
    # the same tokens under an adapter are other K/V: no hit
    hit, _ = run(kv, req("c", b + [1], lora_key="adapter-x"))
    assert hit.num_tokens == 0


def test_files_are_staged_before_the_request_starts(tmp_path):
    import torch

    kv = manager(num_blocks=9, disk_dir=str(tmp_path), disk_bytes=2**20, staging_blocks=4)
    tokens = list(range(300, 313))
    keys = block_keys(chain_seed("model-a", None), tokens, BS)
    for key in keys[:2]:
        write_block(tmp_path, key, "model-a", torch.zeros(1))
    r = req("r", tokens)
    hit = kv.get_computed_blocks(r)
    assert hit.wait_for_kv and hit.num_tokens == 0
    ops = kv.take_offload_ops()
    assert [key for key, _ in ops.prefetch] == keys[:2]
    assert kv.get_computed_blocks(r).wait_for_kv  # the reads are in flight
    kv.offload.apply(OffloadResult(prefetched={keys[0]: True, keys[1]: False}))
    hit = kv.get_computed_blocks(r)
    assert not hit.wait_for_kv and hit.num_tokens == BS  # the good block only
    assert keys[1] in kv.offload._bad
    kv.allocate_slots(r, r.num_tokens - hit.num_tokens, hit)
    assert len(kv.take_offload_ops().load) == 1
    kv.free(r)
    kv.check_integrity()
    again = req("again", tokens)  # the bad file is not read again
    assert not kv.get_computed_blocks(again).wait_for_kv


def test_a_hit_spans_the_tree_and_the_host_tier():
    kv = manager(num_blocks=7, host_blocks=8)  # 6 usable blocks
    a = list(range(100, 116))  # 4 blocks
    run(kv, req("a", a))
    run(kv, req("x", a[:8] + list(range(500, 508))))  # splits a's node after 2 blocks
    run(kv, req("y", list(range(600, 612))))  # 3 blocks: evicts the LRU leaves, a's tail first
    hit = kv.get_computed_blocks(req("a2", a + [1]))
    assert len(hit.blocks) == 2 and hit.offloaded is not None  # the tree's, then host's
    assert hit.num_tokens == 16 and len(hit.offloaded.slots) == 2
    kv.take_offload_ops()
