"""The engine on a bfloat16, float16, int8 or fp8 KV cache under a float32 model: the same
memory holds 2x the tokens in bfloat16 or float16, 64 / 20 = 3.2x the tokens of the tiny model
in int8 (head_dim 16; SmolLM2's 64: 3.8x), 4x in fp8; outputs do not depend on how the cache
got its blocks (prefix-cache reuse, chunked prefill, preemption by recompute or by swap:
quantization is per token, or by a fixed per-head scale, so a recomputed or copied block is
the same bytes), nor on the attention backend that reads it (the C++ kernel with the fused
decode call, the PyTorch oracle: same greedy tokens); a quantized block is never read as
float; SmolLM2's greedy answer survives it."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import assert_kv_all_free, generate_greedy
from tests.engine.test_prefix_caching import run_in_two_waves, workload
from tests.models.test_cpu_decode import _counting_fused_calls
from tokenmill import LLM, SamplingParams

STORAGE = {"bfloat16": torch.bfloat16, "float16": torch.float16, "int8": torch.int8,
           "fp8": torch.float8_e4m3fn}


@pytest.fixture(scope="module", params=list(STORAGE))
def reference(request, tiny_model):
    """Greedy outputs of the workload on a quantized cache through the PyTorch backend."""
    path, _ = tiny_model("llama")
    cases = workload()
    llm = LLM(path, kv_cache_dtype=request.param, num_kv_blocks=200, block_size=8,
              enable_prefix_caching=False, attention_backend="torch")
    return request.param, path, cases, generate_greedy(llm, cases)


@pytest.mark.parametrize("options", [
    {"attention_backend": "auto"},  # the C++ kernel and the fused decode call
    {"enable_prefix_caching": True},
    {"enable_prefix_caching": True, "max_num_batched_tokens": 24},  # chunked prefill
    {"num_kv_blocks": 20, "enable_prefix_caching": False},  # preemption: recompute
    {"num_kv_blocks": 20, "enable_prefix_caching": False, "preemption_mode": "swap"},
])
def test_outputs_do_not_depend_on_how_blocks_were_filled(reference, options, monkeypatch):
    kv_cache_dtype, path, cases, expected = reference
    llm = LLM(path, **({"kv_cache_dtype": kv_cache_dtype, "num_kv_blocks": 200,
                        "block_size": 8, "attention_backend": "torch"} | options))
    fused_calls = _counting_fused_calls(monkeypatch)
    got = (run_in_two_waves(llm, cases) if options.get("enable_prefix_caching")
           else generate_greedy(llm, cases))
    assert got == expected
    if options.get("attention_backend") == "auto":  # the C++ kernel read the cache ...
        assert type(llm.engine.runner.backend).__name__ == "CPUPagedAttention"
        assert fused_calls  # ... and small decode batches took the fused call
    else:
        assert type(llm.engine.runner.backend).__name__ == "TorchPagedAttention"
        assert not fused_calls
    if options.get("num_kv_blocks") == 20:
        assert llm.engine.scheduler.num_preemptions > 0
    if options.get("enable_prefix_caching"):
        assert llm.engine.kv.prefix_hits > 0
    runner = llm.engine.runner
    assert runner.kv_cache.dtype == STORAGE[kv_cache_dtype]
    assert (runner.kv_scales is None) == (kv_cache_dtype != "fp8")
    assert_kv_all_free(llm.engine)


def test_same_memory_holds_about_four_times_the_tokens(tiny_model):
    path, _ = tiny_model("llama")
    blocks = {d: LLM(path, kv_cache_memory="8MiB", kv_cache_dtype=d).engine.runner.num_kv_blocks
              for d in ("auto", "bfloat16", "float16", "int8", "fp8")}
    # head_dim 16: 64 bytes a row in float32, 32 in bfloat16 / float16, 16 + a 4-byte scale
    # in int8 (SmolLM2's 64: 3.8x), 16 in fp8
    assert 1.99 < blocks["bfloat16"] / blocks["auto"] <= 2.0
    assert blocks["float16"] == blocks["bfloat16"]
    assert 3.19 < blocks["int8"] / blocks["auto"] <= 3.2
    assert 3.99 < blocks["fp8"] / blocks["auto"] <= 4.0


@pytest.mark.parametrize("kv_cache_dtype", list(STORAGE))
def test_smollm2_answer_survives_a_quantized_cache(smollm2_path, kv_cache_dtype):
    llm = LLM(smollm2_path, kv_cache_dtype=kv_cache_dtype, kv_cache_memory="64MiB")
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)[0]
    assert out.outputs[0].text == "The capital of France is Paris."


def test_metrics_show_the_capacity_in_tokens(tiny_model):
    import httpx

    from tests.server.conftest import start_server
    from tokenmill.engine.llm_engine import LLMEngine

    engine = LLMEngine.from_options(tiny_model("llama")[0], kv_cache_dtype="int8",
                                    num_kv_blocks=41, block_size=8)
    for srv in start_server(engine, "tiny"):
        text = httpx.get(f"{srv.base_url}/metrics").text
        line = next(x for x in text.splitlines()
                    if x.startswith("tokenmill:kv_cache_capacity_tokens{"))
        assert 'kv_cache_dtype="int8"' in line and float(line.rsplit(" ", 1)[1]) == 40 * 8
