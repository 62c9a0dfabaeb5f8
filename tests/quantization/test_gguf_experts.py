"""A GGUF file's MoE experts served in their own blocks (quantization/gguf_experts.py): a tiny
Mixtral whose stacked experts are K-quants (gate and up of different types: one merged
kernel of two parts) or the split types (Q8_0, Q4_0), loaded by default without a float
copy, decoding the greedy tokens of its float32 expansion."""

from __future__ import annotations

import gguf
import pytest
import torch

from tests.conftest import assert_kv_all_free
from tests.gguf_writer import write_gguf
from tokenmill import LLM, SamplingParams
from tokenmill.layers import cpu_ops
from tokenmill.quantization.base import CPULinearKernel
from tokenmill.quantization.gguf import GGUFConfig
from tokenmill.quantization.gguf_experts import GGUFExpertsMethod, expert_types
from tokenmill.quantization.moe import moe_quant_method

pytestmark = pytest.mark.skipif(not cpu_ops.ops_available(), reason="C++ toolchain unavailable")

KQUANT_EXPERTS = {"ffn_gate_exps": "Q4_K", "ffn_up_exps": "Q5_K", "ffn_down_exps": "Q6_K",
                  "attn_q": "Q4_K", "attn_k": "Q4_K", "attn_v": "Q6_K", "token_embd": "Q8_0"}
SPLIT_EXPERTS = {"ffn_gate_exps": "Q8_0", "ffn_up_exps": "Q8_0", "ffn_down_exps": "Q4_0"}


@pytest.fixture(scope="module")
def expert_files(tmp_path_factory, tiny_model, smollm2_path):
    folder, hf = tiny_model("mixtral-256")
    out = tmp_path_factory.mktemp("gguf-experts")
    paths = {}
    for name, types in (("kquants", KQUANT_EXPERTS), ("split", SPLIT_EXPERTS)):
        paths[name] = str(out / f"tiny-moe-{name}.gguf")
        write_gguf("mixtral", folder, hf, smollm2_path, out / f"tiny-moe-{name}.gguf", types)
    return paths


@pytest.mark.parametrize("name", ["kquants", "split"])
def test_gguf_experts_serve_their_blocks_like_the_float32_expansion(expert_files, name):
    path = expert_files[name]
    prompts = [[1, 504, 3458, 282, 4649, 314], list(range(2000, 2040))]
    params = SamplingParams(temperature=0, max_tokens=10, logprobs=2, ignore_eos=True)
    # a float32 cache as the expansion's (the default is bf16): the weights alone compare
    native = LLM(path, max_model_len=256, num_kv_blocks=64, kv_cache_dtype="float32")
    assert native.engine.config.model.quantization == "gguf"  # by default, experts too
    experts = native.engine.runner.model.model.layers[0].mlp.experts
    assert isinstance(experts.quant_method, GGUFExpertsMethod)
    assert not hasattr(experts, "w13") or experts.w13 is None  # no float copy
    held = sum(p.numel() * p.element_size() for p in experts.parameters())
    stored = sum(t.n_bytes for t in gguf.GGUFReader(path).tensors
                 if t.name.startswith("blk.0.ffn_") and t.name.endswith("_exps.weight"))
    assert stored * 0.99 <= held <= stored * 1.07  # the file's blocks (Q8_0 / Q4_0: split)
    up = experts.quant_method.kernel(experts, "w13", 3)
    if name == "kquants":  # Q4_K gate beside Q5_K up: one merged kernel, two parts
        assert up.kind == CPULinearKernel.PARTS
        assert [row[0] for row in up.tensors[0].tolist()] == [CPULinearKernel.Q4_K,
                                                              CPULinearKernel.Q5_K]
    else:
        assert up.kind == CPULinearKernel.Q8_0
    outs = native.generate(prompts, params, use_tqdm=False)
    assert_kv_all_free(native.engine)
    dense = LLM(path, quantization="none", max_model_len=256, num_kv_blocks=64)
    assert dense.engine.runner.model.model.layers[0].mlp.experts.quant_method is None
    expected = dense.generate(prompts, params, use_tqdm=False)
    for got, want in zip(outs, expected, strict=True):
        assert got.outputs[0].token_ids == want.outputs[0].token_ids
        for lp_got, lp_want in zip(got.outputs[0].logprobs, want.outputs[0].logprobs,
                                   strict=True):
            for token, lp in lp_got.items():  # int16-rounded activations: measured <= 1.3e-3
                assert abs(lp.logprob - lp_want[token].logprob) < 5e-3


@pytest.mark.slow
@pytest.mark.parametrize("types", [KQUANT_EXPERTS, SPLIT_EXPERTS], ids=["kquants", "split"])
def test_gguf_experts_split_over_two_ranks(types, tiny_model, smollm2_path, tmp_path):
    """Tensor parallelism: each rank keeps its rows of w1 / w3 and its columns of w2 (whole
    blocks), and the two ranks' sum decodes the one-process greedy tokens; a share that is
    not whole blocks is refused naming the split."""
    from tests.conftest import no_workers_left

    folder, hf = tiny_model("mixtral-512")
    path = str(tmp_path / "tiny-moe.gguf")
    write_gguf("mixtral", folder, hf, smollm2_path, tmp_path / "tiny-moe.gguf", types)
    prompts = [[1, 504, 3458, 282, 4649, 314], list(range(2000, 2040))]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    one = LLM(path, max_model_len=256, num_kv_blocks=64)
    want = [o.outputs[0].token_ids for o in one.generate(prompts, params, use_tqdm=False)]
    one.engine.shutdown()
    two = LLM(path, tensor_parallel_size=2, max_model_len=256, num_kv_blocks=64)
    try:
        assert two.engine.config.model.quantization == "gguf"
        got = [o.outputs[0].token_ids for o in two.generate(prompts, params, use_tqdm=False)]
    finally:
        two.engine.shutdown()
    assert got == want and no_workers_left()
    if types is KQUANT_EXPERTS:  # 512 / 4 ranks = 128 columns of a 256-weight Q6_K block
        with pytest.raises(Exception, match="tensor-parallel shares"):
            LLM(path, tensor_parallel_size=4, max_model_len=256, num_kv_blocks=64)
    assert no_workers_left()


def test_expert_products_are_the_dense_kernels_of_the_same_bytes(expert_files):
    """Expert e's up product is the raw rows' own dense kernel, side by side, bitwise."""
    native = LLM(expert_files["kquants"], max_model_len=64, num_kv_blocks=16)
    experts = native.engine.runner.model.model.layers[1].mlp.experts
    reader = gguf.GGUFReader(expert_files["kquants"])
    raw = {t.name: torch.from_numpy(t.data.copy()) for t in reader.tensors
           if t.name.startswith("blk.1.ffn_") and t.name.endswith("_exps.weight")}
    x = torch.randn(5, 256)
    for e in (0, 3):
        gate = CPULinearKernel(CPULinearKernel.Q4_K, 32, (raw["blk.1.ffn_gate_exps.weight"][e],))
        up = CPULinearKernel(CPULinearKernel.Q5_K, 32, (raw["blk.1.ffn_up_exps.weight"][e],))
        want = torch.cat([cpu_ops.linear(x, gate), cpu_ops.linear(x, up)], 1)
        assert torch.equal(experts.up(e, x), want)
        down = CPULinearKernel(CPULinearKernel.Q6_K, 32, (raw["blk.1.ffn_down_exps.weight"][e],))
        h = torch.randn(3, 256)
        assert torch.equal(experts.down(e, h), cpu_ops.linear(h, down))


def test_expert_types_and_refusals():
    types = {"model.layers.2.block_sparse_moe.experts.{e}.w1.weight": "Q4_K",
             "model.layers.2.block_sparse_moe.experts.{e}.w3.weight": "Q4_K",
             "model.layers.2.block_sparse_moe.experts.{e}.w2.weight": "Q6_K",
             "model.layers.12.mlp.experts.{e}.gate_proj.weight": "F16",
             "model.layers.12.mlp.experts.{e}.up_proj.weight": "Q8_0",
             "model.layers.12.mlp.experts.{e}.down_proj.weight": "Q8_0"}
    assert expert_types(types, "model.layers.2.mlp.experts") == {"w1": "Q4_K", "w3": "Q4_K",
                                                                  "w2": "Q6_K"}
    assert expert_types(types, "model.layers.1.mlp.experts") == {}
    config = GGUFConfig(types, False, {}, False)
    assert isinstance(moe_quant_method(config, "model.layers.2.mlp.experts"),
                      GGUFExpertsMethod)
    with pytest.raises(ValueError, match="mixes float and block GGUF expert tensors"):
        moe_quant_method(config, "model.layers.12.mlp.experts")
    with pytest.raises(ValueError, match="int8_activations is not implemented for GGUF expert"):
        moe_quant_method(GGUFConfig(types, False, {}, True), "model.layers.2.mlp.experts")
