"""GGUF blocks the kernels read as stored are used in place from the file's memory map
(model_loader/gguf_loader.py `iterate_gguf` in_place, layers/linear.py `fill_span`,
quantization/gguf.py): no copy at load, the pages the page cache's, the map never written, and
released with the model (sleep mode). llama.cpp's q / k row order is undone into a copy, and
blocks split or packed into the kernels' own form (Q4_1, Q8_0; Q4_K on the SIMD builds, Q6_K on
AVX-512 VNNI builds) are copies whose pages are let go."""

from __future__ import annotations

import os
import re

import gguf
import pytest
import torch

from tests.gguf_writer import write_gguf
from tests.quantization.test_gguf_kquants import KQUANT_FILES
from tokenmill import LLM, SamplingParams
from tokenmill.layers import cpu_ops
from tokenmill.quantization.base import CPULinearKernel
from tokenmill.quantization.block_tiles import SUPER_BLOCK_TILES, unpack
from tokenmill.quantization.gguf import GGUF_TYPES

pytestmark = pytest.mark.skipif(not cpu_ops.ops_available(), reason="C++ toolchain unavailable")


def file_mappings(path: str) -> list[dict[str, int]]:
    """This process's mappings of `path`: their address range and their smaps counters (kB)."""
    real = os.path.realpath(path)
    maps, current = [], None
    with open("/proc/self/smaps") as f:
        for line in f:
            head = re.match(r"^([0-9a-f]+)-([0-9a-f]+) \S+ \S+ \S+ \S+\s*(.*)$", line)
            if head:
                current = None
                if head.group(3) == real:
                    current = {"start": int(head.group(1), 16), "end": int(head.group(2), 16)}
                    maps.append(current)
            elif current is not None and ":" in line:
                key, _, value = line.partition(":")
                if value.strip().endswith("kB"):
                    current[key] = int(value.split()[0])
    return maps


def in_a_mapping(tensor: torch.Tensor, maps: list[dict[str, int]]) -> bool:
    start, end = tensor.data_ptr(), tensor.data_ptr() + tensor.numel() * tensor.element_size()
    return any(m["start"] <= start and end <= m["end"] for m in maps)


def resident_pages(start: int, nbytes: int) -> int:
    """How many pages of [start, start + nbytes) are mapped into this process
    (/proc/self/pagemap's present bit)."""
    page = os.sysconf("SC_PAGE_SIZE")
    first, last = start // page, (start + nbytes - 1) // page
    with open("/proc/self/pagemap", "rb") as f:
        f.seek(first * 8)
        entries = f.read((last - first + 1) * 8)
    return sum(int.from_bytes(entries[i:i + 8], "little") >> 63
               for i in range(0, len(entries), 8))


@pytest.fixture(scope="module")
def q4_k_m_file(tmp_path_factory, tiny_model, smollm2_path):
    folder, hf = tiny_model("llama-256")
    path = tmp_path_factory.mktemp("in_place") / "tiny-Q4_K_M.gguf"
    write_gguf("llama", folder, hf, smollm2_path, path, KQUANT_FILES["Q4_K_M"])
    return str(path)


def packed_types() -> set[str]:
    """The K-quant types this build packs into tiles at load (copies of the file's blocks)."""
    return {name for name, t in GGUF_TYPES.items()
            if t.kind in SUPER_BLOCK_TILES and cpu_ops.packs_kind(t.kind)}


def in_place_bytes(path: str) -> int:
    """The bytes of `path`'s blocks the loader uses in place: every K-quant tensor but q and k
    (un-permuted copies) and the types it packs."""
    return sum(t.n_bytes for t in gguf.GGUFReader(path).tensors
               if t.tensor_type.name in KQUANT_FILES["Q4_K_M"].values()
               and ".attn_q." not in t.name and ".attn_k." not in t.name
               and t.tensor_type.name not in packed_types())


def block_params(llm: LLM) -> dict[str, torch.Tensor]:
    return {n: p for n, p in llm.engine.runner.model.named_parameters() if ".blocks_" in n
            or n.endswith("embed_tokens.blocks_0_0")}


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="needs Linux's smaps")
def test_kquant_blocks_are_the_files_pages(q4_k_m_file):
    llm = LLM(q4_k_m_file, max_model_len=128, num_kv_blocks=32)
    maps = file_mappings(q4_k_m_file)
    blocks = block_params(llm)
    assert blocks
    packs_q4_k = "Q4_K" in packed_types()  # SIMD builds: packed into tiles (Q6_K: VNNI)
    stored = {t.name: t for t in gguf.GGUFReader(q4_k_m_file).tensors}
    for name, param in blocks.items():
        # llama.cpp stored q / k rows interleaved for its RoPE: un-permuted, they are copies
        copied = (".qkv_proj.blocks_0_" in name or ".qkv_proj.blocks_1_" in name
                  or param.dim() == 3)  # packed into tiles
        assert in_a_mapping(param, maps) is not copied, name  # (not moved to huge pages)
    # every tensor but q and k (and packed K-quants), byte for byte where the file holds it
    o_proj = llm.engine.runner.model.model.layers[1].self_attn.o_proj.blocks_0_0
    want = stored["blk.1.attn_output.weight"]  # Q5_K
    assert torch.equal(o_proj, torch.from_numpy(want.data.reshape(o_proj.shape).copy()))
    assert o_proj.data_ptr() - min(m["start"] for m in maps) == want.data_offset
    # the Q4_K ffn_down: in place, or packed (its tiles unpack to the file's bytes)
    down = llm.engine.runner.model.model.layers[1].mlp.down_proj.blocks_0_0
    kind = CPULinearKernel.Q4_K_TILES if packs_q4_k else CPULinearKernel.Q4_K
    down_rows = unpack(CPULinearKernel(kind, 32, (down,))).tensors[0]
    assert torch.equal(down_rows, torch.from_numpy(
        stored["blk.1.ffn_down.weight"].data.reshape(down_rows.shape).copy()))
    held = sum(p.numel() for n, p in blocks.items() if in_a_mapping(p, maps))
    assert held == in_place_bytes(q4_k_m_file)
    if packs_q4_k:  # the packed tensors' pages of the map were released after packing
        offset = min(m["start"] for m in maps)
        start = offset + stored["blk.1.ffn_down.weight"].data_offset
        resident = resident_pages(start, stored["blk.1.ffn_down.weight"].n_bytes)
        assert resident <= 2  # (a page it shares with a neighbour kept in place)
    outs = llm.generate([[1, 504, 3458, 282]], SamplingParams(temperature=0, max_tokens=8),
                        use_tqdm=False)
    assert len(outs[0].outputs[0].token_ids) == 8
    # the private map was only read: no page of it was copied on write into this process's
    # own memory ("Anonymous"; a freshly written file's page-cache pages may still count as
    # dirty until written back, which says nothing about this process)
    assert sum(m.get("Anonymous", 0) for m in file_mappings(q4_k_m_file)) == 0


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="needs Linux's smaps")
def test_sleep_lets_the_files_pages_go_and_wake_maps_them_again(q4_k_m_file):
    params = SamplingParams(temperature=0, max_tokens=8)
    llm = LLM(q4_k_m_file, max_model_len=128, num_kv_blocks=32, enable_sleep_mode=True)
    before = llm.generate([[5, 6, 7, 8]], params, use_tqdm=False)[0].outputs[0].token_ids
    mapped = sum(m.get("Rss", 0) for m in file_mappings(q4_k_m_file))
    assert mapped * 1024 >= 0.5 * in_place_bytes(q4_k_m_file)
    llm.sleep(level=1)
    # only the metadata pages the cached GGUF reader touched may stay mapped (the header,
    # the tokenizer's vocabulary among it, ends where the first tensor's data starts)
    header = min(t.data_offset for t in gguf.GGUFReader(q4_k_m_file).tensors)
    assert sum(m.get("Rss", 0) for m in file_mappings(q4_k_m_file)) * 1024 <= header + (64 << 10)
    llm.wake_up()
    maps = file_mappings(q4_k_m_file)
    assert any(in_a_mapping(p, maps) for p in block_params(llm).values())
    assert llm.generate([[5, 6, 7, 8]], params, use_tqdm=False)[0].outputs[0].token_ids == before


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="needs Linux's smaps")
def test_split_blocks_are_copies_and_their_pages_are_released(smollm2_path):
    """Q4_1 / Q8_0 blocks are split into the kernels' arrays (and packed): nothing is kept
    from the map, and the loader hands back each tensor's pages once copied."""
    llm = LLM(smollm2_path, max_model_len=128, num_kv_blocks=32)
    maps = file_mappings(smollm2_path)
    blocks = block_params(llm)
    assert blocks and not any(in_a_mapping(p, maps) for p in blocks.values())
    assert sum(m.get("Rss", 0) for m in maps) * 1024 < 0.1 * os.path.getsize(smollm2_path)


def test_the_automatic_kv_budget_leaves_the_mapped_weights_their_memory(q4_k_m_file,
                                                                        monkeypatch):
    """MemAvailable counts the page cache, the mapped weights among it: the KV cache takes
    half of what is available less those weights (worker/kv_budget.py)."""
    from tokenmill.attention.kv_cache import bytes_per_block
    from tokenmill.utils.file_maps import file_mapped_bytes
    from tokenmill.worker import kv_budget

    available = 128 << 20  # a budget below what 256 sequences of 512 tokens could take
    monkeypatch.setattr(kv_budget, "available_memory", lambda: available)
    llm = LLM(q4_k_m_file, max_model_len=512, max_num_seqs=256)
    runner = llm.engine.runner
    mapped = file_mapped_bytes(runner.model.parameters())
    assert mapped > 0.5 * in_place_bytes(q4_k_m_file)
    per_block = bytes_per_block(runner.num_layers, runner.block_size, runner.num_kv_heads,
                                llm.engine.config.model.head_dim, llm.engine.config.model.dtype,
                                llm.engine.config.cache.kv_cache_dtype)
    assert runner.num_kv_blocks == int((available - mapped) * kv_budget.FREE_FRACTION) // per_block
