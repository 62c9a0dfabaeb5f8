"""The KV format registry: one object per format is what the option, the CLI, the cache's
layout and the torch paths all read."""

import argparse

import pytest
import torch

from tokenmill.attention.kv_cache import allocate_kv_cache, as_float, bytes_per_block, store_kv
from tokenmill.attention.kv_formats import (
    KV_FORMATS,
    PLANNED_KV_FORMATS,
    format_of_storage,
    kv_format,
    kv_format_names,
)


@pytest.mark.parametrize("name", list(KV_FORMATS))
def test_a_cache_tensor_names_its_format(name):
    """The invariant the kernels dispatch on: a cache allocated for a format holds storage
    that maps back to that format, and its bytes are what sizing counts."""
    fmt = kv_format(name)
    cache = allocate_kv_cache(2, 3, 4, 2, 8, torch.float32, torch.device("cpu"), name)
    # "float32" names a float32 model's "auto" cache: the same storage, read as "auto"
    assert format_of_storage(cache.dtype) is (kv_format("auto") if name == "float32" else fmt)
    assert cache.nelement() * cache.element_size() == bytes_per_block(2, 4, 2, 8, torch.float32,
                                                                      name) * 3
    assert cache.shape[-1] == fmt.row(8, torch.float32)[0]


@pytest.mark.parametrize("name", list(KV_FORMATS))
def test_rows_written_read_back_within_the_formats_step(name):
    """store_kv's torch path (non-contiguous k, so the C++ op declines) writes each format's
    rows, and as_float reads them back: exactly for the float format, within half a step
    (bfloat16: 2^-8 relative; float16: 2^-11 relative above 2^-14, 2^-25 absolute below;
    int8: max|x| / 254 per row; e4m3: 1/16 relative, 2^-10 absolute below its normals)."""
    fmt = kv_format(name)
    gen = torch.Generator().manual_seed(0)
    cache = allocate_kv_cache(1, 4, 4, 2, 8, torch.float32, torch.device("cpu"), name)[0]
    scales = fmt.head_scales(1, 2, torch.device("cpu"))
    scales = None if scales is None else scales[0]
    kv = torch.randn(2, 5, 2, 16, generator=gen)[..., ::2]  # (2, T, Hkv, D), strided: torch path
    slots = torch.tensor([0, 3, 6, 9, 15])
    store_kv(cache, kv[0], kv[1], slots, scales)
    back = as_float(cache.view(2, -1, 2, cache.shape[-1])[:, slots], scales, torch.float32)
    if name in ("auto", "float32"):
        assert torch.equal(back, kv)
        return
    bound = {"bfloat16": kv.abs() * 2.0 ** -8,
             "float16": kv.abs() * 2.0 ** -11 + 2.0 ** -25,
             "int8": kv.abs().amax(-1, keepdim=True) / 254,
             "fp8": kv.abs() / 16 + 2.0 ** -10}[name]
    assert bool(((back - kv).abs() <= bound * 1.0001).all())
    assert not torch.equal(back, kv)  # the format rounds


def test_names_aliases_and_refusals():
    assert kv_format("fp8_e4m3") is kv_format("fp8")
    assert set(kv_format_names()) == {"auto", "float32", "bfloat16", "float16", "int8", "fp8",
                                     "fp8_e4m3"}
    for name in PLANNED_KV_FORMATS:
        with pytest.raises(ValueError, match="not built yet"):
            kv_format(name)
    known = "'auto' or 'float32' or 'bfloat16' or 'float16' or 'int8' or 'fp8' or 'fp8_e4m3'"
    with pytest.raises(ValueError, match=f"{known}, got 'int4'"):
        kv_format("int4")


def test_the_cli_offers_the_registry():
    from tokenmill.engine_args import EngineArgs

    p = argparse.ArgumentParser()
    EngineArgs.add_cli_args(p)
    action = next(a for a in p._actions if a.dest == "kv_cache_dtype")
    assert action.choices == [*kv_format_names(), *PLANNED_KV_FORMATS]
