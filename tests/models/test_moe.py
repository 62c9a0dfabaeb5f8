"""Mixture of experts (layers/fused_moe.py, models/mixtral.py): the grouped expert layer equals
Hugging Face's sparse MoE block; a tiny random-weight Mixtral is greedy-identical to HF with
chunked prefill, prefix hits and preemption, in one process and split over two (the experts'
intermediate features sharded); the fused CPU decode call is provably not taken; quantized
expert weights are refused, not silently left unquantized."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import generate_greedy, hf_greedy, mixed_prompts, no_workers_left
from tokenmill import LLM
from tokenmill.layers.fused_moe import FusedMoE, grouped_experts, masked_experts, select_experts


def _hf_block_and_ours(seed: int = 0):
    import transformers
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    cfg = transformers.MixtralConfig(hidden_size=48, intermediate_size=80, num_local_experts=6,
                                     num_experts_per_tok=2)
    torch.manual_seed(seed)
    hf = MixtralSparseMoeBlock(cfg).eval()
    for p in hf.parameters():
        torch.nn.init.normal_(p, std=0.2)
    ours = FusedMoE(6, 2, 48, 80, renormalize=True)
    for e in range(6):
        gate_up = hf.experts.gate_up_proj[e]
        ours.weight_loader(ours.w13, gate_up[:80], (e, "w1"))
        ours.weight_loader(ours.w13, gate_up[80:], (e, "w3"))
        ours.weight_loader(ours.w2, hf.experts.down_proj[e], (e, "w2"))
    return hf, ours


@torch.no_grad()
@pytest.mark.parametrize("tokens", [1, 3, 64])
def test_grouped_experts_equal_hugging_face_s_block(tokens):
    hf, ours = _hf_block_and_ours()
    x = torch.randn(tokens, 48)
    expected = hf(x[None])[0]
    logits = torch.nn.functional.linear(x, hf.gate.weight)
    got = ours(x, logits)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)
    weights, ids = select_experts(logits, 2, True)
    torch.testing.assert_close(weights.sum(-1), torch.ones(tokens))
    assert torch.equal(grouped_experts(x, ours.w13, ours.w2, weights, ids, ours.act),
                       masked_experts(x, ours.w13, ours.w2, weights, ids, ours.act))


@pytest.mark.parametrize("tp", [1, 2])
def test_mixtral_greedy_is_identical_to_hf(tiny_model, tp):
    path, hf = tiny_model("mixtral")
    cases = mixed_prompts(8, 49152, seed=3, max_len=120, max_new=20)
    llm = LLM(path, tensor_parallel_size=tp, num_kv_blocks=40, block_size=8,
              max_num_batched_tokens=64, max_num_seqs=6)
    try:
        got = generate_greedy(llm, cases) + generate_greedy(llm, cases[-1:])
        engine = llm.engine
        assert engine.scheduler.num_preemptions > 0 and engine.kv.prefix_hits > 0
        if tp == 1:  # the fused CPU decode call's allow-list names Llama's MLP only
            assert engine.runner.model.model.small_batch_decode._plan is None
    finally:
        llm.engine.shutdown()
    assert got == [hf_greedy(hf, p, m) for p, m in cases + cases[-1:]]
    assert no_workers_left()


def test_quantized_experts_are_refused(tiny_model):
    path, _ = tiny_model("mixtral")
    with pytest.raises(ValueError, match="quantized expert weights are not supported yet"):
        LLM(path, quantization="int8")
