"""KV tiers end to end on a tiny model: greedy output identical to Hugging Face with and
without each tier, through hits that span the tree and a tier, after eviction, under
preemption and chunked prefill; the repeat pass computes far fewer prompt tokens; a new
process on the same directory is served from disk; corrupt, truncated and foreign files are
ignored."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from tests.conftest import assert_kv_all_free, generate_greedy, hf_greedy
from tokenmill import LLM
from tokenmill.kv_offload.block_file import MAGIC, write_block

SMALL_POOL = dict(num_kv_blocks=20, block_size=8)  # holds about one prompt


def repeat_workload(seed: int = 0, n: int = 6, length: int = 96):
    """n distinct prompts, then each again with a new suffix: the repeat pass."""
    rng = random.Random(seed)
    words = lambda k: [rng.randrange(3, 4000) for _ in range(k)]
    prompts = [words(length) for _ in range(n)]
    return ([(p + words(5), 6) for p in prompts], [(p + words(7), 6) for p in prompts])


@pytest.fixture(scope="module")
def reference(tiny_model):
    path, hf = tiny_model("llama")
    first, repeat = repeat_workload()
    expected = [hf_greedy(hf, p, m) for p, m in first + repeat]
    return path, first, repeat, expected


def _run(llm: LLM, first, repeat) -> tuple[list[list[int]], int]:
    """Outputs of both passes, and the prompt tokens the repeat pass computed."""
    out = generate_greedy(llm, first)
    before = llm.engine.stats().num_prompt_tokens_computed
    out += generate_greedy(llm, repeat)
    return out, llm.engine.stats().num_prompt_tokens_computed - before


def _check_clean(llm: LLM) -> None:
    assert_kv_all_free(llm.engine)
    llm.engine.kv.check_integrity()


def test_without_a_tier_the_repeat_pass_recomputes(reference):
    path, first, repeat, expected = reference
    llm = LLM(path, **SMALL_POOL)
    out, computed = _run(llm, first, repeat)
    assert out == expected
    assert computed > 0.9 * sum(len(p) for p, _ in repeat)  # the pool lost the prefixes


def test_cpu_tier_serves_evicted_prefixes(reference):
    path, first, repeat, expected = reference
    llm = LLM(path, **SMALL_POOL, kv_offloading_size="64MiB")
    out, computed = _run(llm, first, repeat)
    assert out == expected
    offload = llm.engine.kv.offload
    assert offload.hit_tokens["cpu"] >= 6 * 88  # each prefix's whole blocks (96 // 8 - 1)
    assert computed < 0.2 * sum(len(p) for p, _ in repeat)
    assert offload.bytes_saved["cpu"] > 0 and offload.bytes_loaded["cpu"] > 0
    _check_clean(llm)


@pytest.mark.parametrize("tier", ["cpu", "disk"])
def test_tiers_under_chunked_prefill_and_preemption(reference, tier, tmp_path):
    path, first, repeat, expected = reference
    options = ({"kv_offloading_size": "64MiB"} if tier == "cpu" else
               {"kv_offloading_size": "64MiB", "kv_offloading_dir": str(tmp_path)})
    llm = LLM(path, **SMALL_POOL, **options, max_num_batched_tokens=40)
    out = generate_greedy(llm, first + repeat)  # all at once: preemptions
    assert out == expected
    assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.kv.offload.hit_tokens[tier] > 0
    _check_clean(llm)


def test_a_small_cpu_tier_keeps_what_fits(reference):
    path, first, repeat, expected = reference
    llm = LLM(path, **SMALL_POOL, kv_offloading_size="40KiB")  # 10 blocks of 4 KiB
    out, _ = _run(llm, first, repeat)
    assert out == expected
    assert len(llm.engine.kv.offload.host) == llm.engine.config.kv_offload.host_blocks
    _check_clean(llm)


def _fill_disk(reference, directory: Path) -> dict:
    """The first pass in an engine with a disk tier on `directory`, shut down (the blocks
    still cached are saved too; the writes finish); the options a restart takes."""
    path, first, _, expected = reference
    opts = dict(**SMALL_POOL, kv_offloading_backend="disk", kv_offloading_size="64MiB",
                kv_offloading_dir=str(directory))
    writer = LLM(path, **opts)
    assert generate_greedy(writer, first) == expected[:len(first)]
    writer.engine.shutdown()
    return opts


def test_disk_tier_survives_a_restart(reference, tmp_path):
    path, first, repeat, expected = reference
    opts = _fill_disk(reference, tmp_path)
    files = list(tmp_path.glob("*/*.kv"))
    assert len(files) >= 6 * 12
    reader = LLM(path, **opts)  # a new engine on the same directory
    before = reader.engine.stats().num_prompt_tokens_computed
    assert generate_greedy(reader, repeat) == expected[len(first):]
    computed = reader.engine.stats().num_prompt_tokens_computed - before
    assert reader.engine.kv.offload.hit_tokens["disk"] >= 6 * 88
    assert computed < 0.2 * sum(len(p) for p, _ in repeat)
    _check_clean(reader)


def test_bad_files_are_ignored(reference, tmp_path):
    path, first, repeat, expected = reference
    opts = _fill_disk(reference, tmp_path)
    files = sorted(tmp_path.glob("*/*.kv"))
    for i, f in enumerate(files):
        data = bytearray(f.read_bytes())
        if i % 3 == 0:  # a flipped byte in the payload
            data[-5] ^= 0x40
            f.write_bytes(bytes(data))
        elif i % 3 == 1:  # truncated
            f.write_bytes(bytes(data[:len(data) // 2]))
        else:  # another model's block under this name
            _rewrite_as_foreign(f)
    reader = LLM(path, **opts)
    assert generate_greedy(reader, repeat) == expected[len(first):]
    offload = reader.engine.kv.offload
    assert offload.hit_tokens["disk"] == 0 and len(offload._bad) > 0
    _check_clean(reader)


def _rewrite_as_foreign(f: Path) -> None:
    import torch
    key = bytes.fromhex(f.stem)
    f.unlink()
    write_block(f.parent.parent, key, "another-model", torch.zeros(4, dtype=torch.float32))
    assert f.read_bytes().startswith(MAGIC)


def test_async_scheduling_with_the_cpu_tier(reference):
    path, first, repeat, expected = reference
    llm = LLM(path, **SMALL_POOL, kv_offloading_size="64MiB", async_scheduling=True)
    out, computed = _run(llm, first, repeat)
    assert out == expected
    assert computed < 0.2 * sum(len(p) for p, _ in repeat)
    _check_clean(llm)


def _transfer(role: str, directory: Path) -> dict:
    return {"kv_connector": "SharedStorageConnector", "kv_role": role,
            "kv_connector_extra_config": {"shared_storage_path": str(directory)}}


def test_producer_then_consumer_through_shared_storage(reference, tmp_path):
    path, first, _, expected = reference
    producer = LLM(path, kv_transfer_config=_transfer("kv_producer", tmp_path))
    prefill = [(p, 1) for p, _ in first]  # the proxy's max_tokens 1
    assert generate_greedy(producer, prefill) == [e[:1] for e in expected[:len(first)]]
    consumer = LLM(path, kv_transfer_config=_transfer("kv_consumer", tmp_path))
    assert generate_greedy(consumer, first) == expected[:len(first)]
    prompt_tokens = sum(len(p) for p, _ in first)
    computed = consumer.engine.stats().num_prompt_tokens_computed
    assert computed <= len(first) * 16  # each prompt's tail past its last whole block
    assert consumer.engine.kv.offload.hit_tokens["shared"] == prompt_tokens - computed
    assert not list(tmp_path.glob("*/.tmp-*"))
    _check_clean(consumer)


def test_consumer_without_kv_computes_the_prompt(reference, tmp_path):
    path, first, _, expected = reference
    consumer = LLM(path, kv_transfer_config=_transfer("kv_consumer", tmp_path))
    assert generate_greedy(consumer, first) == expected[:len(first)]
    assert consumer.engine.stats().num_prompt_tokens_computed == sum(len(p) for p, _ in first)


@pytest.mark.slow
def test_cpu_tier_under_tensor_parallelism(reference):
    """TP = 2: each rank keeps its share of the KV heads in its own host tier, the same
    copies sent to both."""
    path, first, repeat, expected = reference
    llm = LLM(path, **SMALL_POOL, kv_offloading_size="64MiB", tensor_parallel_size=2)
    try:
        out, computed = _run(llm, first, repeat)
        assert out == expected
        assert computed < 0.2 * sum(len(p) for p, _ in repeat)
        _check_clean(llm)
    finally:
        llm.engine.shutdown()
