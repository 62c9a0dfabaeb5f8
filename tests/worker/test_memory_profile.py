"""worker/memory_profile.py: the KV budget from a profiled step (--gpu-memory-utilization).

The arithmetic and the profiled step's requests are checked here on CPU, and the step itself
runs on a CPU runner (its forward pass, logits and sampler on a cache of its own, leaving the
engine's cache and sampler as they were). On a CUDA machine (benchmarks/gpu_session.sh) the
last test starts engines at two utilizations and checks the device's memory against them.
"""

from __future__ import annotations

import argparse

import pytest
import torch

from tests.conftest import generate_greedy, hf_greedy, mixed_prompts
from tokenmill import LLM
from tokenmill.config_factory import create_engine_config
from tokenmill.engine_args import EngineArgs
from tokenmill.worker.memory_profile import (
    MemoryProfile,
    profile_cache,
    profile_requests,
    run_profile_step,
)

GiB = 2**30


def test_kv_budget_is_the_share_left_after_use_and_activations():
    p = MemoryProfile(total=80 * GiB, in_use=20 * GiB, activation_peak=2 * GiB)
    assert p.kv_budget(0.9) == 72 * GiB - 22 * GiB
    assert p.kv_budget(0.5) == 40 * GiB - 22 * GiB
    assert p.kv_budget(0.25) < 0  # nothing left: start-up fails with the figures


def _config(tiny_model, **kw):
    folder, _ = tiny_model("llama")
    return create_engine_config(EngineArgs(model=folder, device="cpu", **kw))


@pytest.mark.parametrize("kw, tokens, seqs", [
    (dict(max_num_batched_tokens=300, max_num_seqs=8), 300, 8),
    (dict(max_num_batched_tokens=5, max_num_seqs=8), 5, 5),  # fewer tokens than sequences
    # one sequence holds at most max_model_len tokens: the rest go to the next ones
    (dict(max_num_batched_tokens=1200, max_num_seqs=4, max_model_len=512), 1200, 4),
])
def test_profile_requests_are_the_largest_step(tiny_model, kw, tokens, seqs):
    config = _config(tiny_model, **kw)
    reqs = profile_requests(config, 16)
    assert sum(r.num_tokens for r in reqs) == tokens and len(reqs) == seqs
    assert all(1 <= r.num_tokens <= config.model.max_model_len for r in reqs)
    assert reqs[0].num_tokens == min(tokens - seqs + 1, config.model.max_model_len)
    blocks = [b for r in reqs for b in r.block_ids]
    assert blocks == list(range(1, len(blocks) + 1))  # disjoint, never the null block 0
    assert all(len(r.block_ids) * 16 >= r.num_tokens for r in reqs)
    assert all(r.sample and r.sampling_params.top_p < 1 and r.sampling_params.top_k > 0
               and r.sampling_params.seed is not None for r in reqs)


def test_profile_step_leaves_the_engine_as_it_was(tiny_model):
    folder, hf = tiny_model("llama")
    cases = [(p, min(m, 8)) for p, m in mixed_prompts(4, hf.config.vocab_size, seed=3)]
    llm = LLM(folder, max_num_batched_tokens=256, max_num_seqs=8, dtype="float32")
    runner = llm.engine.runner
    assert generate_greedy(llm, cases[:2]) == [hf_greedy(hf, p, m) for p, m in cases[:2]]
    cache_before = runner.kv_cache.clone()
    rng_before = runner.sampler._global.get_state()
    reqs = profile_requests(llm.engine.config, runner.block_size)
    with profile_cache(runner, 1 + sum(len(r.block_ids) for r in reqs)):
        assert runner.kv_cache.shape[2] == 1 + sum(len(r.block_ids) for r in reqs)
        run_profile_step(runner, reqs)
        profiled = runner.kv_cache
        assert profiled[:, :, 1:].abs().sum() > 0  # the step wrote its own cache
    assert torch.equal(runner.kv_cache, cache_before)  # the engine's cache untouched
    assert all(a.kv_cache.data_ptr() == runner.kv_cache[i].data_ptr()
               for i, a in enumerate(runner.model.attention_layers()))  # bound again
    assert torch.equal(runner.sampler._global.get_state(), rng_before)
    assert not runner.sampler._generators
    # and the engine serves on, token for token
    assert generate_greedy(llm, cases) == [hf_greedy(hf, p, m) for p, m in cases]


def test_gpu_memory_utilization_option(tiny_model):
    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    folder, _ = tiny_model("llama")
    args = parser.parse_args(["--model", folder, "--gpu-memory-utilization", "0.5"])
    assert create_engine_config(EngineArgs.from_cli_args(args)).cache.gpu_memory_utilization \
        == 0.5
    assert create_engine_config(EngineArgs(model=folder)).cache.gpu_memory_utilization == 0.9
    for bad in (0, 1.5, -0.1):
        with pytest.raises(ValueError, match="gpu_memory_utilization"):
            create_engine_config(EngineArgs(model=folder, gpu_memory_utilization=bad))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_kv_cache_takes_the_profiled_share_of_the_device(tiny_model):
    """On the GPU (benchmarks/gpu_session.sh runs this file alone, before the parallel tests):
    the KV cache is the share left after what was in use and the step's peak, in whole
    blocks, or what the longest batch needs when that is less."""
    from tokenmill.attention.kv_cache import bytes_per_block
    from tokenmill.worker.kv_budget import longest_batch_bytes

    folder, hf = tiny_model("llama")
    cases = [(p, min(m, 8)) for p, m in mixed_prompts(3, hf.config.vocab_size, seed=2)]
    # capped by the need; by the share (0.1 of an 80 GB or 141 GB card is below what 100,000
    # sequences need, ~26 GB)
    for util, seqs in ((0.3, 8), (0.1, 100_000)):
        llm = LLM(folder, gpu_memory_utilization=util, max_num_seqs=seqs, dtype="float32")
        runner = llm.engine.runner
        profile = runner.memory_profile
        free, total = torch.cuda.mem_get_info()
        assert profile.total == total and profile.activation_peak > 0
        assert profile.in_use >= sum(p.numel() * p.element_size()
                                     for p in runner.model.parameters())
        config, mc = llm.engine.config, llm.engine.config.model
        block = bytes_per_block(runner.num_layers, runner.block_size, runner.num_kv_heads,
                                mc.head_dim, mc.dtype, config.cache.kv_cache_dtype)
        budget = min(profile.kv_budget(util), longest_batch_bytes(config, block))
        assert runner.num_kv_blocks == budget // block
        assert (budget == profile.kv_budget(util)) == (seqs == 100_000)
        assert generate_greedy(llm, cases) == [hf_greedy(hf, p, m) for p, m in cases]
        del llm, runner
        torch.cuda.empty_cache()
