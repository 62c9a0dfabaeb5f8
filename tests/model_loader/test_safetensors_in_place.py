"""A half-precision safetensors checkpoint is used in place from the files' memory maps
(model_loader/safetensors_loader.py, layers/linear.py `fill_span`, quantization/unquantized.py):
each weight the CPU kernels read as stored is the file's bytes, a merged layer's parts are
multiplied side by side with the bits of one merged weight, the maps are never written and go
with the model (sleep mode); the pages of tensors copied instead are let go as they are copied.
"""

from __future__ import annotations

import os

import pytest
import torch
from safetensors import safe_open

from tests.model_loader.test_gguf_in_place import file_mappings, in_a_mapping
from tokenmill import LLM, SamplingParams
from tokenmill.layers import cpu_ops
from tokenmill.model_loader import loader
from tokenmill.model_loader.safetensors_loader import iterate_safetensors
from tokenmill.quantization.base import CPULinearKernel, merged_kernel

pytestmark = [
    pytest.mark.skipif(not cpu_ops.ops_available(), reason="C++ toolchain unavailable"),
    pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="needs Linux's smaps"),
]

PROMPTS = [[1, 504, 3458, 282, 4649, 314], list(range(2000, 2040))]


@pytest.fixture(autouse=True)
def no_amx_packing():
    """Weights packed for AMX tiles are copies by design: keep vdpbf16ps's kind, read as
    stored, on a CPU that has AMX too."""
    before = cpu_ops.bf16_products_amx(False)
    yield
    cpu_ops.bf16_products_amx(before)


@pytest.fixture
def in_place(monkeypatch):
    """A tiny checkpoint mapped as a large one is (loader.SAFETENSORS_IN_PLACE_SHARE)."""
    monkeypatch.setattr(loader, "SAFETENSORS_IN_PLACE_SHARE", 0.0)


def weight_files(folder: str) -> list[str]:
    return sorted(os.path.join(folder, f) for f in os.listdir(folder)
                  if f.endswith(".safetensors"))


def stored_tensors(folder: str) -> dict[str, torch.Tensor]:
    tensors = {}
    for path in weight_files(folder):
        with safe_open(path, framework="pt") as f:
            tensors |= {name: f.get_tensor(name).clone() for name in f.keys()}  # noqa: SIM118
    return tensors


def maps_of(folder: str) -> list[dict[str, int]]:
    return [m for path in weight_files(folder) for m in file_mappings(path)]


def test_bf16_weights_are_the_files_bytes(bf16_checkpoint, in_place):
    folder = bf16_checkpoint
    llm = LLM(folder, max_model_len=128, num_kv_blocks=32)
    model = llm.engine.runner.model
    maps, stored = maps_of(folder), stored_tensors(folder)
    layer = model.model.layers[1]
    # a merged layer holds its checkpoint tensors as parts, each the file's bytes
    qkv = layer.self_attn.qkv_proj
    for part, name in zip((qkv.weight_0, qkv.weight_1, qkv.weight_2), "qkv", strict=True):
        assert in_a_mapping(part, maps), name
        assert torch.equal(part, stored[f"model.layers.1.self_attn.{name}_proj.weight"])
    gate_up = layer.mlp.gate_up_proj
    assert torch.equal(gate_up.weight_1, stored["model.layers.1.mlp.up_proj.weight"])
    held = [p for n, p in model.named_parameters() if p.dtype == torch.bfloat16]
    assert held and all(in_a_mapping(p, maps) for p in held)  # every bf16 weight, the table too
    assert all(not in_a_mapping(p, maps) for p in model.parameters() if p.dtype != torch.bfloat16)
    kernel = qkv.quant_method.cpu_kernel(qkv)
    assert kernel.kind == CPULinearKernel.PARTS
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 8 for o in outs)
    # the private maps were only read: no page copied on write into this process's memory
    assert sum(m.get("Anonymous", 0) for m in maps_of(folder)) == 0


@pytest.mark.parametrize("matmul", ["auto", "float32"])
def test_in_place_parts_give_the_copies_tokens_bit_for_bit(bf16_checkpoint, matmul,
                                                           monkeypatch):
    """The same weights used in place (parts: bf16 products, or widened and joined per part)
    and copied into merged parameters (a small checkpoint's default): the same tokens and
    log-probabilities, bit for bit."""
    params = SamplingParams(temperature=0, max_tokens=8, logprobs=2, ignore_eos=True)
    copied = LLM(bf16_checkpoint, max_model_len=128, num_kv_blocks=32, matmul_dtype=matmul)
    assert not hasattr(copied.engine.runner.model.model.layers[0].self_attn.qkv_proj,
                       "weight_0")  # one merged weight
    want = copied.generate(PROMPTS, params, use_tqdm=False)
    monkeypatch.setattr(loader, "SAFETENSORS_IN_PLACE_SHARE", 0.0)
    mapped = LLM(bf16_checkpoint, max_model_len=128, num_kv_blocks=32, matmul_dtype=matmul)
    assert hasattr(mapped.engine.runner.model.model.layers[0].self_attn.qkv_proj, "weight_2")
    got = mapped.generate(PROMPTS, params, use_tqdm=False)
    for g, w in zip(got, want, strict=True):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        assert g.outputs[0].logprobs == w.outputs[0].logprobs


def test_a_small_checkpoint_is_copied(bf16_checkpoint):
    """Below SAFETENSORS_IN_PLACE_SHARE of the memory the weights are copies (in 2 MiB pages,
    which decode faster than the page cache's 4 KiB ones), merged as before."""
    llm = LLM(bf16_checkpoint, max_model_len=128, num_kv_blocks=32)
    model = llm.engine.runner.model
    maps = maps_of(bf16_checkpoint)
    assert not any(in_a_mapping(p, maps) for p in model.parameters())
    assert model.model.layers[0].self_attn.qkv_proj.weight.dtype == torch.bfloat16


def test_parts_multiply_with_the_bits_of_one_merged_weight(cpu_ops_build):
    """A held qkv / gate_up (PARTS of bf16 products) shares one rounding of x and writes each
    part's columns: bitwise the kernel of the rows joined into one weight, at every M, on
    every build and both paths (AVX512-BF16 where the CPU has it, the emulation)."""
    build = cpu_ops_build
    parts = [(torch.randn(n, 96) * 0.05).to(torch.bfloat16) for n in (64, 16, 16, 7)]
    joined = CPULinearKernel(CPULinearKernel.BF16_PRODUCTS, 0, (torch.cat(parts),))
    merged = merged_kernel([CPULinearKernel(CPULinearKernel.BF16_PRODUCTS, 0, (w,))
                            for w in parts])
    bias = torch.randn(103)
    paths = [True, False] if build.bf16_products_hardware(None) else [False]
    try:
        for hardware in paths:
            build.bf16_products_hardware(hardware)
            for m in (1, 2, 3, 4, 5, 13, 70):
                x = torch.randn(m, 96)
                assert torch.equal(cpu_ops.linear(x, merged, bias, build=build),
                                   cpu_ops.linear(x, joined, bias, build=build)), (hardware, m)
    finally:  # the switch's default (one switch for every build: a static of an inline
        build.bf16_products_hardware(True)  # function, unified across the loaded modules)


def test_sleep_lets_the_maps_go_and_wake_maps_them_again(bf16_checkpoint, in_place):
    folder = bf16_checkpoint
    params = SamplingParams(temperature=0, max_tokens=8)
    llm = LLM(folder, max_model_len=128, num_kv_blocks=32, enable_sleep_mode=True)
    before = llm.generate(PROMPTS, params, use_tqdm=False)
    assert maps_of(folder)
    llm.sleep(level=1)
    assert not maps_of(folder)
    llm.wake_up()
    assert maps_of(folder)
    after = llm.generate(PROMPTS, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in after] == [o.outputs[0].token_ids for o in before]


@pytest.mark.parametrize("kept", [True, False], ids=["in-place", "copied"])
def test_kept_tensors_are_populated_and_copied_ones_released(bf16_checkpoint, kept):
    """The iterator maps a kept tensor's pages at once (the first step would fault them one by
    one) and lets a copied one's go as the next is asked for; either way the tensors read as
    the file holds them (a dropped page of a private, unwritten map comes back from the
    file)."""
    folder = bf16_checkpoint
    # each tensor copied before the next is asked for, as the loader copies what it does
    # not keep: reading it maps its pages
    tensors = {n: (t, t.clone()) for n, t in iterate_safetensors(folder, lambda name: kept)}
    size = sum(os.path.getsize(f) for f in weight_files(folder))
    resident = sum(m.get("Rss", 0) for m in maps_of(folder)) * 1024
    if kept:
        assert resident >= 0.9 * size
    else:
        assert resident < 0.1 * size  # (the last tensor's pages may stay)
    stored = stored_tensors(folder)
    assert all(torch.equal(t, stored[n]) and torch.equal(copy, stored[n])
               for n, (t, copy) in tensors.items())
