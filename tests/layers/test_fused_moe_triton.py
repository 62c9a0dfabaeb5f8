"""The Triton fused-MoE kernel (layers/fused_moe_triton.py), compiled on a CUDA machine and
otherwise run by Triton's interpreter on CPU tensors (TRITON_INTERPRET=1, tests/conftest.py):
the block alignment pads each expert's
pairs to whole blocks, and the two grouped GEMM launches equal the grouped PyTorch path to
float32 rounding, for shapes whose edges are not multiples of the kernel's blocks, experts that
receive nothing, and a tiny Mixtral run end to end on that path (greedy == HF)."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import generate_greedy, hf_greedy, mixed_prompts
from tokenmill.attention.triton_paged import triton_available
from tokenmill.layers.fused_moe import FusedMoE, select_experts

pytestmark = pytest.mark.skipif(not triton_available(), reason="triton not installed")
# where the kernel runs: compiled on a GPU, interpreted on CPU tensors elsewhere
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def test_align_block_size_pads_each_expert_to_whole_blocks():
    from tokenmill.layers.fused_moe_triton import align_block_size

    ids = torch.tensor([[2, 0], [2, 3], [0, 2]])  # expert 1 gets nothing
    pairs, block_expert = align_block_size(ids, 4, block_m=4)
    # sized by T k + E (block_m - 1) = 18 pairs → 5 blocks, whatever the routing; the blocks
    # past the experts' runs are padding alone
    assert block_expert.tolist() == [0, 2, 3, 3, 3]
    pad = ids.numel()
    assert pairs.tolist() == [1, 4, pad, pad, 0, 2, 5, pad, 3, pad, pad, pad] + [pad] * 8
    # every pair to one expert: the same sizes (what a CUDA graph of the step needs)
    same_sizes = align_block_size(torch.zeros_like(ids), 4, block_m=4)
    assert [t.shape for t in same_sizes] == [pairs.shape, block_expert.shape]
    assert same_sizes[0][:8].tolist() == [0, 1, 2, 3, 4, 5, pad, pad]


@torch.no_grad()
@pytest.mark.parametrize("tokens, experts, top_k, hidden, inter",
                         [(1, 4, 2, 64, 96), (7, 6, 2, 48, 80), (40, 8, 3, 64, 40)])
def test_fused_experts_equal_the_grouped_path(tokens, experts, top_k, hidden, inter):
    from tokenmill.layers.fused_moe_triton import fused_experts

    torch.manual_seed(tokens)
    layer = FusedMoE(experts, top_k, hidden, inter, renormalize=True)
    for p in (layer.w13, layer.w2):
        torch.nn.init.normal_(p, std=0.1)
    layer.to(DEVICE)
    layer.use_triton = False  # the layer's own forward: the grouped PyTorch path
    x, logits = torch.randn(tokens, hidden), torch.randn(tokens, experts)
    x, logits = x.to(DEVICE), logits.to(DEVICE)
    weights, ids = select_experts(logits, top_k, True)
    got = fused_experts(x, layer.w13, layer.w2, weights, ids)
    torch.testing.assert_close(got, layer(x, logits), rtol=1e-5, atol=1e-5)


def test_tiny_mixtral_on_the_triton_path_matches_hf(tiny_model, monkeypatch):
    """Every FusedMoE layer forced onto the kernel (as on a GPU): greedy == HF."""
    monkeypatch.setattr(FusedMoE, "use_triton", True)
    path, hf = tiny_model("mixtral")
    from tokenmill import LLM

    cases = mixed_prompts(3, 49152, seed=13, max_len=24, max_new=4)
    llm = LLM(path, dtype="float32")  # on CUDA "auto" would be bfloat16
    try:
        assert generate_greedy(llm, cases) == [hf_greedy(hf, p, m) for p, m in cases]
    finally:
        llm.engine.shutdown()
