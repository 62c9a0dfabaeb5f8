"""bfloat16 / float16 checkpoints on CPU keep their weights as stored (no float32 copy): the dot
kernels widen them in registers (csrc/linear_half.h), exactly, so every product equals the
float32 kernel's on the widened weights bit for bit, and a model's greedy tokens and logprobs
equal its float32 load's and Hugging Face's (float32, same weights).

matmul_dtype bfloat16 (by default where the CPU has AVX512-BF16) multiplies bfloat16 weights in
bfloat16 (csrc/linear_bf16.h; the kernel's own tests: tests/layers/test_bf16_products.py) with
a bfloat16 KV cache: lossy, its top-1 agreement with the float32 products is tested here. Where
the CPU has AMX-BF16 the loader packs those weights for tiles in place (kind BF16_TILES,
csrc/linear_bf16_amx.h), a tied table too."""

from __future__ import annotations

import dataclasses
import json
import shutil

import pytest
import torch

from tests.conftest import agreement, assert_kv_all_free, hf_greedy, top1
from tokenmill import LLM, SamplingParams
from tokenmill.config_weights import asked_half_weights
from tokenmill.engine_args import engine_config
from tokenmill.layers import cpu_ops
from tokenmill.quantization.base import CPULinearKernel

pytestmark = pytest.mark.skipif(not cpu_ops.ops_available(), reason="C++ toolchain unavailable")
HALF = {torch.bfloat16: CPULinearKernel.BF16, torch.float16: CPULinearKernel.F16}
# the kind a bf16 weight multiplied in bf16 takes here (whole tiles: the tiny models' shapes)
PRODUCTS = CPULinearKernel.BF16_TILES if cpu_ops.ops_available() and \
    cpu_ops.bf16_products_amx() else CPULinearKernel.BF16_PRODUCTS


@pytest.mark.parametrize("dtype", list(HALF))
@pytest.mark.parametrize("invariant", [True, False])
def test_products_equal_float32_on_the_widened_weights(dtype, invariant):
    w = (torch.randn(72, 576) * 0.05).to(dtype)
    half = CPULinearKernel(HALF[dtype], 0, (w,), batch_invariant=invariant)
    dense = CPULinearKernel(CPULinearKernel.DENSE, 0, (w.float(),))
    bias = torch.randn(72)
    for m in (1, 2, 3, 4, 5, 13, 70):
        x = torch.randn(m, 576)
        assert torch.equal(cpu_ops.linear(x, half, bias), cpu_ops.linear(x, dense, bias))
    rows = torch.tensor([5, 0, 71, 5])
    assert torch.equal(cpu_ops.gather_rows(rows, half), w.float()[rows])


@pytest.fixture(scope="module", params=[torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def half_model(request, tiny_model, tmp_path_factory):
    """The tiny Llama written as a half-precision checkpoint, and HF's float32 model of the
    same (rounded) weights."""
    import transformers

    folder, _ = tiny_model("llama")
    out = tmp_path_factory.mktemp(f"llama-{request.param}")
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=request.param)
    hf.save_pretrained(out)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(f"{folder}/{f}", out / f)
    reference = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    return str(out), request.param, reference.eval()


def test_a_half_checkpoint_keeps_its_weights_and_decodes_as_float32(half_model):
    path, dtype, reference = half_model
    config = engine_config(path, device="cpu", matmul_dtype="float32")
    assert config.model.dtype == torch.float32 and config.model.weight_dtype == dtype
    # the cache: float16 for float16 weights (next test); float32 for bf16 weights multiplied
    # in float32. Asked in float32, both are float32's exactly.
    assert config.model.matmul_dtype is None and config.cache.kv_cache_dtype == \
        ("float16" if dtype == torch.float16 else "auto")
    llm = LLM(path, num_kv_blocks=64, matmul_dtype="float32", kv_cache_dtype="float32")
    model = llm.engine.runner.model
    qkv = model.model.layers[0].self_attn.qkv_proj
    assert qkv.weight.dtype == dtype and qkv.quant_method.cpu_kernel(qkv).kind == HALF[dtype]
    assert model.model.embed_tokens.weight.dtype == dtype
    assert model.model.norm.weight.dtype == torch.float32  # norms stay float32
    prompts = [[1, 504, 3458, 282, 4649, 314], list(range(2000, 2050))]
    params = SamplingParams(temperature=0, max_tokens=10, logprobs=2, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert_kv_all_free(llm.engine)
    f32 = LLM(path, dtype="float32", num_kv_blocks=64)  # the same weights widened at load
    assert f32.engine.config.model.weight_dtype is None
    expected = f32.generate(prompts, params, use_tqdm=False)
    for got, want, prompt in zip(outs, expected, prompts, strict=True):
        assert got.outputs[0].token_ids == want.outputs[0].token_ids
        assert got.outputs[0].logprobs == want.outputs[0].logprobs  # bitwise
        assert list(got.outputs[0].token_ids) == hf_greedy(reference, prompt, 10)


def test_asking_a_half_checkpoints_own_dtype_serves_it_as_auto_does(half_model):
    """`dtype="bfloat16"` for a bf16 checkpoint (the dtype vLLM's CPU backend runs), "float16"
    for an fp16 one: the weights kept as stored and computed as dtype="auto" computes them,
    bit for bit, not every module in half precision through torch's ops. A bf16 checkpoint
    asked in float16 (whose range float16 would cut) is served as asked; the reverse is the
    next test's."""
    path, dtype, _ = half_model
    own = "bfloat16" if dtype == torch.bfloat16 else "float16"
    asked, auto = engine_config(path, device="cpu", dtype=own), engine_config(path, device="cpu")
    assert asked.model.dtype == torch.float32 and asked.model.weight_dtype == dtype
    assert asked.model.matmul_dtype == auto.model.matmul_dtype
    assert asked.cache.kv_cache_dtype == auto.cache.kv_cache_dtype
    if dtype == torch.bfloat16:
        elsewhere = engine_config(path, device="cpu", dtype="float16").model
        assert elsewhere.dtype == torch.float16 and elsewhere.weight_dtype is None
    prompts = [[1, 504, 3458, 282, 4649, 314], list(range(2000, 2050))]
    params = SamplingParams(temperature=0, max_tokens=8, logprobs=2, ignore_eos=True)
    got = LLM(path, dtype=own, num_kv_blocks=64).generate(prompts, params, use_tqdm=False)
    want = LLM(path, num_kv_blocks=64).generate(prompts, params, use_tqdm=False)
    for g, w in zip(got, want, strict=True):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        assert g.outputs[0].logprobs == w.outputs[0].logprobs


def test_a_float16_checkpoint_asked_in_bfloat16_serves_as_its_bfloat16_copy(half_model,
                                                                            tmp_path):
    """`dtype="bfloat16"` for a float16 checkpoint on CPU (what vLLM's CPU backend serves an
    fp16 model in): its weights rounded to bfloat16 as they load and served as the same model
    saved in bfloat16 is by default (bf16 products where the CPU has them, their bf16 cache),
    bit for bit; not every module in bfloat16 through torch's ops."""
    import transformers

    path, dtype, _ = half_model
    if dtype != torch.float16:
        pytest.skip("a float16 checkpoint")
    copy = tmp_path / "bf16-copy"
    transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16) \
        .save_pretrained(copy)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(f"{path}/{f}", copy / f)
    asked, saved = engine_config(path, device="cpu", dtype="bfloat16"), engine_config(str(copy))
    assert asked.model.dtype == torch.float32 and asked.model.weight_dtype == torch.bfloat16
    assert asked.model.matmul_dtype == saved.model.matmul_dtype
    assert asked.cache.kv_cache_dtype == saved.cache.kv_cache_dtype
    llm = LLM(path, dtype="bfloat16", num_kv_blocks=64)
    qkv = llm.engine.runner.model.model.layers[0].self_attn.qkv_proj
    assert {w.dtype for w in qkv.parameters()} == {torch.bfloat16}
    prompts = [[1, 504, 3458, 282, 4649, 314], list(range(2000, 2050))]
    params = SamplingParams(temperature=0, max_tokens=8, logprobs=2, ignore_eos=True)
    got = llm.generate(prompts, params, use_tqdm=False)
    assert_kv_all_free(llm.engine)
    want = LLM(str(copy), num_kv_blocks=64).generate(prompts, params, use_tqdm=False)
    for g, w in zip(got, want, strict=True):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        assert g.outputs[0].logprobs == w.outputs[0].logprobs


def test_a_float32_checkpoint_asked_in_half_precision_serves_as_its_half_checkpoint(
        half_model, tiny_model):
    """`dtype="bfloat16"` (or "float16") for a float32 checkpoint on CPU: its weights rounded
    to that dtype as they load, kept so (no float32 copy), and served as the same model saved
    in that dtype is by default, bit for bit; not every module in half precision through
    torch's ops (the dtype asked for on a GPU)."""
    half_path, dtype, _ = half_model
    f32_path = tiny_model("llama")[0]
    name = str(dtype).removeprefix("torch.")
    asked, saved = engine_config(f32_path, device="cpu", dtype=name), engine_config(half_path)
    assert asked.model.dtype == torch.float32 and asked.model.weight_dtype == dtype
    assert asked.model.matmul_dtype == saved.model.matmul_dtype
    assert asked.cache.kv_cache_dtype == saved.cache.kv_cache_dtype
    as_asked = dataclasses.replace(engine_config(f32_path, device="cpu").model, dtype=dtype)
    assert asked_half_weights(as_asked, "cuda") is None  # a GPU runs the dtype as asked
    llm = LLM(f32_path, dtype=name, num_kv_blocks=64)
    qkv = llm.engine.runner.model.model.layers[0].self_attn.qkv_proj
    assert {w.dtype for w in qkv.parameters()} == {dtype}  # no float32 copy beside them
    assert llm.engine.runner.model.model.norm.weight.dtype == torch.float32
    prompts = [[1, 504, 3458, 282, 4649, 314], list(range(2000, 2050))]
    params = SamplingParams(temperature=0, max_tokens=8, logprobs=2, ignore_eos=True)
    got = llm.generate(prompts, params, use_tqdm=False)
    assert_kv_all_free(llm.engine)
    want = LLM(half_path, num_kv_blocks=64).generate(prompts, params, use_tqdm=False)
    for g, w in zip(got, want, strict=True):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        assert g.outputs[0].logprobs == w.outputs[0].logprobs


def test_a_config_naming_no_dtype_asked_in_half_precision_is_float32s(tiny_model, tmp_path):
    """A config without `dtype` (transformers reads it as float32's; the random-weight shapes of
    tokenmill/bench/shapes.py) asked in bfloat16 is served as the float32 checkpoint is."""
    f32_path = tiny_model("llama")[0]
    bare = tmp_path / "bare"
    shutil.copytree(f32_path, bare)
    config = json.loads((bare / "config.json").read_text())
    config.pop("dtype", None), config.pop("torch_dtype", None)
    (bare / "config.json").write_text(json.dumps(config))
    got = engine_config(str(bare), device="cpu", dtype="bfloat16")
    want = engine_config(f32_path, device="cpu", dtype="bfloat16")
    assert got.model.weight_dtype == want.model.weight_dtype == torch.bfloat16
    assert got.model.dtype == torch.float32
    assert got.cache.kv_cache_dtype == want.cache.kv_cache_dtype


def test_an_f16_gguf_file_keeps_its_weights_in_f16(tiny_model, smollm2_path, tmp_path):
    from tests.gguf_writer import write_gguf

    folder, hf = tiny_model("llama")
    path = str(tmp_path / "tiny-F16.gguf")
    write_gguf("llama", folder, hf, smollm2_path, tmp_path / "tiny-F16.gguf",
               {n: "F16" for n in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate",
                                   "ffn_up", "ffn_down", "token_embd")})
    native = LLM(path, num_kv_blocks=64, kv_cache_dtype="float32")  # the expansion's cache
    assert native.engine.config.model.quantization == "gguf"  # its own F16, by default
    mlp = native.engine.runner.model.model.layers[1].mlp
    assert [p.dtype for p in mlp.gate_up_proj.parameters()] == [torch.float16] * 2  # gate, up
    prompts = [[1, 504, 3458, 282, 4649, 314]]
    params = SamplingParams(temperature=0, max_tokens=10, logprobs=2, ignore_eos=True)
    got = native.generate(prompts, params, use_tqdm=False)[0].outputs[0]
    want = LLM(path, quantization="none", num_kv_blocks=64).generate(
        prompts, params, use_tqdm=False)[0].outputs[0]
    assert got.token_ids == want.token_ids and got.logprobs == want.logprobs


def test_a_float16_checkpoint_keeps_a_float16_cache(half_model, monkeypatch):
    """A float16 checkpoint's K and V are cached in float16 by default (as vLLM keeps an fp16
    model's), not float32: the same memory holds twice the tokens; the C++ store, kernel and
    fused decode call write and read it; a request's tokens do not depend on its neighbours.
    Lossy (11 bits of mantissa): teacher-forced top-1 agreement with a float32 cache on the
    same weights, >= 99% (measured 100% here; SmolLM2 in float16: RESULTS.md)."""
    from tests.models.test_cpu_decode import _counting_fused_calls

    path, dtype, reference = half_model
    if dtype != torch.float16:
        pytest.skip("a float16 checkpoint's cache")
    half = LLM(path, kv_cache_memory="4MiB")
    assert half.engine.config.cache.kv_cache_dtype == "float16"
    assert half.engine.runner.kv_cache.dtype == torch.float16
    exact = LLM(path, kv_cache_memory="4MiB", kv_cache_dtype="float32")
    assert exact.engine.runner.kv_cache.dtype == torch.float32
    assert half.engine.runner.num_kv_blocks == 2 * exact.engine.runner.num_kv_blocks
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 3000, (80,), generator=g).tolist() for _ in range(30)]
    assert agreement(top1(half, prompts), top1(exact, prompts)) >= 0.99
    calls = _counting_fused_calls(monkeypatch)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    outs = half.generate(prompts[:3], params, use_tqdm=False)
    assert calls  # decode steps took the fused call
    assert_kv_all_free(half.engine)
    alone = [half.generate([p], params, use_tqdm=False)[0] for p in prompts[:3]]
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in alone]
    assert [list(o.outputs[0].token_ids) for o in outs] == \
        [hf_greedy(reference, p, 8) for p in prompts[:3]]


def test_bf16_products_run_every_path_with_a_bf16_cache(bf16_checkpoint, monkeypatch):
    """matmul_dtype bfloat16, on any CPU (emulated without AVX512-BF16, the same bits): the
    products' kernel, a bfloat16 KV cache, the fused decode call, batch invariance. On this
    tiny random model, whose logits are flat (float32's median top-2 margin 0.27 nats), top-1
    agreement with the float32 products is 97.4%: it must stay within 0.95 and 1 (the
    real-model figure, >= 99%, is the next test's)."""
    from tests.models.test_cpu_decode import _counting_fused_calls

    fast = LLM(bf16_checkpoint, matmul_dtype="bfloat16", num_kv_blocks=256)
    config = fast.engine.config
    assert config.model.matmul_dtype == torch.bfloat16
    assert config.cache.kv_cache_dtype == "bfloat16"  # auto: the products' dtype
    model = fast.engine.runner.model
    mlp = model.model.layers[0].mlp
    assert mlp.down_proj.quant_method.cpu_kernel(mlp.down_proj).kind == PRODUCTS
    assert model.model.norm.weight.dtype == torch.float32
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 3000, (80,), generator=g).tolist() for _ in range(30)]
    exact = LLM(bf16_checkpoint, matmul_dtype="float32", num_kv_blocks=256)
    assert 0.95 <= agreement(top1(fast, prompts), top1(exact, prompts)) < 1.0
    calls = _counting_fused_calls(monkeypatch)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    outs = fast.generate(prompts[:3], params, use_tqdm=False)
    assert calls  # decode steps took the fused call, in the same kernels
    assert_kv_all_free(fast.engine)
    alone = [fast.generate([p], params, use_tqdm=False)[0] for p in prompts[:3]]
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in alone]


def test_amx_tiles_hold_each_weight_once_and_a_tied_table_looks_up_from_them(bf16_checkpoint):
    """Where the CPU has AMX-BF16, every projection and the tied embedding table are packed
    in place (no dense copy beside them); lookups give the checkpoint's rows. Switched off
    (cpu_ops.bf16_products_amx(False), as TOKENMILL_AMX=0), the loader keeps kind
    BF16_PRODUCTS."""
    from safetensors.torch import load_file

    if not cpu_ops.bf16_products_amx():
        pytest.skip("this CPU has no AMX-BF16 tiles")
    table = load_file(f"{bf16_checkpoint}/model.safetensors")["model.embed_tokens.weight"]
    model = LLM(bf16_checkpoint, matmul_dtype="bfloat16", num_kv_blocks=64).engine.runner.model
    linears = [m for m in model.modules() if hasattr(m, "quant_method") and
               any(True for _ in m.parameters(recurse=False))]
    assert len(linears) > 4
    for layer in linears:
        assert layer.weight.dim() == 4, layer
        assert layer.quant_method.cpu_kernel(layer).kind == CPULinearKernel.BF16_TILES
    ids = torch.tensor([[0, 7, 16], [table.shape[0] - 1, 31, 7]])
    assert torch.equal(model.model.embed_tokens(ids), table.float()[ids])
    before = cpu_ops.bf16_products_amx(False)
    try:
        kept = LLM(bf16_checkpoint, matmul_dtype="bfloat16", num_kv_blocks=64)
    finally:
        cpu_ops.bf16_products_amx(before)
    mlp = kept.engine.runner.model.model.layers[0].mlp
    assert mlp.down_proj.weight.dim() == 2
    assert mlp.down_proj.quant_method.cpu_kernel(mlp.down_proj).kind == \
        CPULinearKernel.BF16_PRODUCTS


def test_a_bf16_gguf_file_multiplies_like_its_bf16_checkpoint(bf16_checkpoint, tiny_model,
                                                               smollm2_path, tmp_path):
    """A GGUF file of BF16 tensors takes the bf16 products as a bf16 HF checkpoint does (by
    default where the CPU has AVX512-BF16; asked for, on any CPU): the same bf16 weights (the
    gguf package and torch round alike), so the same tokens and logprobs, bit for bit. A file
    with BF16 beside quantized tensors keeps float32 products unless asked; one without BF16
    refuses them."""
    from tests.gguf_writer import write_gguf
    from tokenmill.utils import cpp_extension

    folder, hf = tiny_model("llama")
    matrices = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up",
                "ffn_down", "token_embd")
    files = {"bf16": {n: "BF16" for n in matrices}, "mixed": {"ffn_down": "BF16",
             "attn_q": "Q8_0"}, "q8": {"attn_q": "Q8_0"}}
    for name, types in files.items():
        write_gguf("llama", folder, hf, smollm2_path, tmp_path / f"{name}.gguf", types)
    path = str(tmp_path / "bf16.gguf")
    hardware = cpp_extension.has_bf16_instructions()
    assert engine_config(path, device="cpu").model.matmul_dtype == \
        (torch.bfloat16 if hardware else None)
    native = LLM(path, matmul_dtype="bfloat16", num_kv_blocks=64)
    assert native.engine.config.cache.kv_cache_dtype == "bfloat16"
    mlp = native.engine.runner.model.model.layers[1].mlp
    assert mlp.down_proj.quant_method.cpu_kernel(mlp.down_proj).kind == PRODUCTS
    prompts = [[1, 504, 3458, 282, 4649, 314], list(range(2000, 2030))]
    params = SamplingParams(temperature=0, max_tokens=8, logprobs=2, ignore_eos=True)
    got = native.generate(prompts, params, use_tqdm=False)
    want = LLM(bf16_checkpoint, matmul_dtype="bfloat16", num_kv_blocks=64).generate(
        prompts, params, use_tqdm=False)
    for g, w in zip(got, want, strict=True):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        assert g.outputs[0].logprobs == w.outputs[0].logprobs
    mixed = str(tmp_path / "mixed.gguf")
    assert engine_config(mixed, device="cpu").model.matmul_dtype is None
    assert engine_config(mixed, device="cpu", matmul_dtype="bfloat16").model.matmul_dtype == \
        torch.bfloat16
    with pytest.raises(ValueError, match="BF16 tensors"):
        engine_config(str(tmp_path / "q8.gguf"), device="cpu", matmul_dtype="bfloat16")


@pytest.mark.slow
def test_bf16_products_keep_smollm2s_top1_above_99_percent(smollm2_bf16):
    """SmolLM2 as a bf16 checkpoint, on 1,000 positions of English text: its bfloat16
    products (and cache) pick float32's top-1 token at >= 99% of them (measured: 99.3% by
    benchmarks/quant_quality.py --matmul-dtype bfloat16, 2,044 positions)."""
    from tokenmill.bench.quant_quality import calibration_text

    folder = smollm2_bf16
    exact = LLM(folder, matmul_dtype="float32", max_model_len=512)
    ids = exact.engine.tokenizer.encode(calibration_text(8000), add_special_tokens=False)
    prompts = [ids[i:i + 250] for i in range(0, 1000, 250)]
    want = top1(exact, prompts)
    del exact
    fast = LLM(folder, matmul_dtype="bfloat16", max_model_len=512)
    agreed = agreement(top1(fast, prompts), want)
    assert 0.99 <= agreed < 1.0, agreed


def test_matmul_dtype_is_chosen_by_the_cpu_and_refused_where_it_does_not_apply(
        bf16_checkpoint, tiny_model):
    import argparse

    from tokenmill.engine_args import EngineArgs
    from tokenmill.utils import cpp_extension

    hardware = cpp_extension.has_bf16_instructions()
    assert hardware == cpu_ops.bf16_products_hardware()  # the kernel's own run-time check
    auto = engine_config(bf16_checkpoint, device="cpu")
    assert auto.model.matmul_dtype == (torch.bfloat16 if hardware else None)
    assert auto.cache.kv_cache_dtype == ("bfloat16" if hardware else "auto")
    for asked, expected in (("bfloat16", torch.bfloat16), ("float32", None)):
        parser = argparse.ArgumentParser()
        EngineArgs.add_cli_args(parser)
        args = parser.parse_args(["--model", bf16_checkpoint, "--matmul-dtype", asked])
        assert EngineArgs.from_cli_args(args).create_engine_config() \
            .model.matmul_dtype == expected
    kept = engine_config(bf16_checkpoint, device="cpu", matmul_dtype="bfloat16",
                         kv_cache_dtype="int8")
    assert kept.cache.kv_cache_dtype == "int8"  # a cache format asked for is kept
    with pytest.raises(ValueError, match="bfloat16 checkpoint"):
        engine_config(tiny_model("llama")[0], device="cpu", matmul_dtype="bfloat16")
    # (a GGUF file's BF16 tensors: test_a_bf16_gguf_file_multiplies_like_its_bf16_checkpoint)
    with pytest.raises(ValueError, match="bfloat16 checkpoint"):
        engine_config(bf16_checkpoint, device="cpu", dtype="float32", matmul_dtype="bfloat16")
