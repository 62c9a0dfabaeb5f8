"""DecodeGraphs' static buffers and padding, end to end against Hugging Face.

Without a GPU the graphs cannot be captured, so DecodeGraphs runs with capture=False: every
plain decode step still goes through the static buffers, padded to a capture size, with the
Triton kernel (in Triton's interpreter on CPU: tests/conftest.py), exactly what a replay would
compute. On a CUDA machine the engine captures real graphs and the second test replays them.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.conftest import assert_kv_all_free, generate_greedy, hf_greedy, mixed_prompts
from tokenmill import LLM
from tokenmill.attention.triton_paged import triton_available

pytestmark = pytest.mark.skipif(not triton_available(), reason="triton not installed")


@pytest.fixture(scope="module")
def llama_cases(tiny_model):
    path, hf = tiny_model("llama")
    # Prompts of 1, 300, 17, 2, 130 and 64 tokens, up to 12 new tokens: decode batches shrink
    # from 6 (padded to 8) down to 1 as requests finish.
    cases = [(p, min(m, 12)) for p, m in mixed_prompts(6, hf.config.vocab_size, seed=1)]
    return path, cases, [hf_greedy(hf, p, m) for p, m in cases]


def test_padded_static_decode_matches_hf(llama_cases):
    path, cases, expected = llama_cases
    llm = LLM(path, attention_backend="triton", max_num_batched_tokens=64, dtype="float32")
    runner = llm.engine.runner
    if runner.device.type == "cpu":
        assert runner.decode_graphs is None  # graphs are for CUDA only
        runner.decode_graphs = runner._decode_graphs(capture=False)
    assert graphs_unsupported_by(runner, "torch")  # backends opt in
    graphs = runner.decode_graphs
    assert graphs.sizes[:5] == [1, 2, 4, 8, 16]
    assert generate_greedy(llm, cases) == expected
    assert graphs.num_replays >= 11  # every decode step after the prefills
    # Then three requests of 5 tokens (batches of 3 padded to 4): row 3, which a batch of 6
    # used above, must be padding again (no stale slot or block table of a finished request).
    assert generate_greedy(llm, [(p, 5) for p, _ in cases[:3]]) == [e[:5] for e in expected[:3]]
    attn = graphs.attention  # the Triton backend's static buffers
    meta = attn.metadata(4, graphs.positions)  # what the last replay computed
    assert graphs.positions[3] == 0 and attn.block_tables[3, 0] == 0
    assert meta.slot_mapping[3] == 0 and meta.tiles[0].first_ctx[3] == 1
    assert_kv_all_free(llm.engine)


@pytest.mark.parametrize("split_keys", [512, 32])
def test_graph_metadata_is_the_eager_metadata_of_a_decode_step(split_keys):
    """The metadata a graph computes on the device from its positions and block tables is
    the one the backend builds on the host for the same decode step (slots, context lengths,
    block-table rows, queries), its split work the same items in a dense layout, the padding
    rows on the null block."""
    from tests.attention.test_paged_backends import kernel_device
    from tokenmill.attention.input_batch import InputBatch
    from tokenmill.attention.triton_paged import TritonPagedAttention
    from tokenmill.core.interface import ScheduledRequest
    from tokenmill.sampling_params import SamplingParams

    device = kernel_device("triton")
    backend = TritonPagedAttention(16, device, max_model_len=1024)
    backend.split_keys = split_keys
    state = backend.decode_graph_state(8, 64)
    positions = torch.zeros(8, dtype=torch.long, device=device)
    starts, tables = [0, 37, 300, 16, 15], [[3], [5, 9, 2], list(range(10, 29)), [4, 6], [7]]
    reqs = [ScheduledRequest(req_id=str(i), token_ids=[1], start_pos=p, block_ids=t,
                             sample=True, sampling_params=SamplingParams())
            for i, (p, t) in enumerate(zip(starts, tables, strict=True))]
    batch = InputBatch.build(reqs, 16, device)
    eager = backend.build_metadata(batch)
    state.block_tables.fill_(99)  # what earlier steps left
    assert state.load(batch, 8)
    positions[:5] = batch.positions
    graph = state.metadata(8, positions)
    assert graph.slot_mapping[:5].tolist() == eager.slot_mapping.tolist()
    assert graph.slot_mapping[5:].tolist() == [0, 0, 0]  # padding: slot 0, the null block
    e, g = eager.tiles[0], graph.tiles[0]
    assert g.first_ctx.tolist() == e.first_ctx.tolist() + [1, 1, 1]
    for name in ("rows", "q_starts", "q_lens"):
        assert getattr(g, name)[:5].tolist() == getattr(e, name).tolist()
    rows = g.block_tables[:5, :batch.block_tables.shape[1]]
    assert rows.tolist() == batch.block_tables.tolist()
    # the same (row, split) items (eager: only where some decode has two splits); each
    # row's first item where the merge looks for it
    assert (e.split is None) == (split_keys == 512)
    work = e.split or backend._split_work(e.first_ctx.cpu().numpy().astype(np.int64))
    dense = {(int(t), int(s)) for t, s in zip(g.split.work_tiles, g.split.work_splits,
                                              strict=True)
             if s * split_keys < g.first_ctx[t]}
    assert dense == {(int(t), int(s)) for t, s in zip(work.work_tiles, work.work_splits,
                                                      strict=True)} | {(5, 0), (6, 0), (7, 0)}
    starts_at = g.split.tile_work_start.tolist()
    assert all(g.split.work_tiles[i] == t and g.split.work_splits[i] == 0
               for t, i in enumerate(starts_at))
    # The unsplit variant of a small graph: the same metadata without split work, chosen
    # only when every row's keys fit one split (as the eager rule above).
    assert state.variants(8) == (False, True) and state.variants(24) == (True,)
    assert state.variant(batch, 8) == (split_keys == 32) and state.variant(batch, 24)
    one = state.metadata(8, positions, False)
    assert one.tiles[0].split is None
    assert one.slot_mapping.tolist() == graph.slot_mapping.tolist()
    assert one.tiles[0].first_ctx.tolist() == g.first_ctx.tolist()
    # not a plain decode step: left to the eager path, nothing copied
    chunk = InputBatch.build([ScheduledRequest(req_id="c", token_ids=[1, 2], start_pos=0,
                                               block_ids=[1], sample=True,
                                               sampling_params=SamplingParams())], 16, device)
    before = state.block_tables.clone()
    assert not state.load(chunk, 1) and torch.equal(state.block_tables, before)


def test_padded_static_decode_with_split_keys_matches_hf(llama_cases):
    """The static buffers with several splits per sequence (128 keys each here, so the
    300-token prompt's decodes take 3, the 130-token one's 2): work items, padding rows'
    items and the items a smaller batch leaves unused. (Each item is a program of Triton's
    interpreter on CPU: 32-key splits had made this the suite's slowest test, 55 s.)"""
    path, cases, expected = llama_cases
    llm = LLM(path, attention_backend="triton", max_num_batched_tokens=64, dtype="float32")
    runner = llm.engine.runner
    runner.backend.split_keys = 128  # the static state is built (and graphs captured) anew
    runner.decode_graphs = runner._decode_graphs(capture=runner.device.type == "cuda")
    runner.decode_graphs.capture_all()  # (nothing to capture on CPU)
    state = runner.decode_graphs.attention
    assert state.split_keys == 128 and state.max_splits == -(-512 // 128)
    assert generate_greedy(llm, cases) == expected
    # batches of up to 6 rows: unsplit graphs while every context fits 128 keys, split ones
    # from the step one passes it (the 300- and 130-token prompts' decodes)
    replayed = runner.decode_graphs.replays
    assert {v for _, v in replayed} == {False, True}, replayed
    assert generate_greedy(llm, [(p, 5) for p, _ in cases[:3]]) == [e[:5] for e in expected[:3]]
    assert_kv_all_free(llm.engine)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_cuda_graph_replays_match_eager(llama_cases):
    path, cases, expected = llama_cases
    eager = LLM(path, enforce_eager=True, dtype="float32")
    assert eager.engine.runner.decode_graphs is None
    graphed = LLM(path, dtype="float32")
    assert generate_greedy(eager, cases) == expected
    assert generate_greedy(graphed, cases) == expected
    assert graphed.engine.runner.decode_graphs.num_replays > 0


def graphs_unsupported_by(runner, backend_name: str) -> bool:
    """Whether a backend without a graph state gets no DecodeGraphs (its steps run eagerly)."""
    from tokenmill.attention import get_attention_backend

    saved = runner.backend
    runner.backend = get_attention_backend(backend_name, runner.block_size, runner.device)
    try:
        return runner._decode_graphs(capture=False) is None
    finally:
        runner.backend = saved


def test_asked_graph_sizes_pad_and_leave_larger_batches_eager(llama_cases):
    """--cuda-graph-sizes 3 5: batches of up to 3 rows replay (padded to) the size-3 graph,
    of 4 or 5 the size-5 one, and the 6-row batch runs eagerly; greedy equal to HF."""
    path, cases, expected = llama_cases
    llm = LLM(path, attention_backend="triton", max_num_batched_tokens=64, dtype="float32",
              cuda_graph_sizes=[5, 3])
    runner = llm.engine.runner
    if runner.device.type == "cpu":
        runner.decode_graphs = runner._decode_graphs(capture=False)
    graphs = runner.decode_graphs
    assert graphs.sizes == [3, 5]
    assert generate_greedy(llm, cases) == expected
    sizes_replayed = {size for size, _ in graphs.replays}
    assert sizes_replayed == {3, 5}
    # every decode step of 6 rows ran eagerly: the replays are the steps of 5 rows or fewer
    assert graphs.num_replays < sum(m for _, m in cases)
    assert_kv_all_free(llm.engine)


@pytest.mark.parametrize("max_num_seqs, asked, want", [
    (256, (32,), [1, 2, 4, 8, 16, 24, 32]),  # one value: vLLM's sizes up to it
    (256, (20,), [1, 2, 4, 8, 16, 20]),
    (1024, (1024,), [*range(8, 257, 8), *range(272, 1025, 16)]),  # past 512, every 16
    (64, (1, 2, 128), [1, 2, 64]),  # several: those sizes; over max_num_seqs: max_num_seqs
    (64, (48, 8, 8), [8, 48]),
    (16, (512,), [1, 2, 4, 8, 16]),
])
def test_asked_capture_sizes(max_num_seqs, asked, want):
    from tokenmill.worker.cuda_graphs import DecodeGraphs

    sizes = DecodeGraphs.capture_sizes(max_num_seqs, asked)
    assert sizes[-len(want):] == want and sizes == sorted(set(sizes))


@pytest.mark.parametrize("max_num_seqs", [1, 3, 8, 64, 100, 256, 300, 512, 1024])
def test_capture_sizes_bound_the_padding(max_num_seqs):
    """vLLM's capture sizes, capped at max_num_seqs (which is added): every batch up to the
    last size is padded by at most 7 rows up to 256 sequences and 15 beyond, so from 64
    sequences on padding is under 12% of a step's rows; larger batches run eagerly."""
    from tokenmill.worker.cuda_graphs import DecodeGraphs

    sizes = DecodeGraphs.capture_sizes(max_num_seqs)
    assert sizes == sorted(set(sizes)) and sizes[0] == 1
    assert sizes[-1] == min(max_num_seqs, 512)
    for n in range(1, sizes[-1] + 1):
        padded = next(s for s in sizes if s >= n)
        assert padded - n <= (7 if n <= 256 else 15), n
        if n >= 64:
            assert (padded - n) / padded < 0.12, n
    if max_num_seqs >= 24:
        assert sizes[:6] == [1, 2, 4, 8, 16, 24]
