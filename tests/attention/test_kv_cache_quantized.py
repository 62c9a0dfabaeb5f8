"""KV caches that round what they store (attention/kv_formats.py): bfloat16 rows under a
float32 model, int8 rows with their float32 scale beside them (one per token and KV head) and
fp8 e4m3 with fixed per-head scales.

- formats: round-trip error bounds; stores at slots; block copies carry the scales; the real
  bytes per block set the capacity; bad formats are refused at configuration;
- stores: the C++ op (one pass, csrc/kv_formats.h) and the Triton kernel write the same
  bytes as the torch ops;
- reads: every backend (PyTorch, the oracle; the C++ kernel, its AVX-512 / AVX2 build as this
  CPU runs; Triton, in its interpreter) on a bfloat16, an int8 and an fp8 cache gives dense
  attention over the values the cache holds, within float32 tolerance (1e-5; the values are
  the same, only the order of summation differs).
"""

from __future__ import annotations

import pytest
import torch

from tests.attention.test_paged_backends import (
    BACKENDS,
    MIXED,
    assert_attention_close,
    build_step,
    kernel_device,
    needs_kernel,
    needs_triton,
    run,
)
from tokenmill.attention.cpu_kernels import bf16_rounds_qp, paged_attention_op
from tokenmill.attention.kv_cache import (
    allocate_kv_cache,
    as_float,
    bytes_per_block,
    copy_blocks,
    on_grid,
    store_kv,
)
from tokenmill.attention.kv_formats import KV_FORMATS, kv_format
from tokenmill.config import CacheConfig
from tokenmill.layers import cpu_ops

FP8 = torch.float8_e4m3fn
FORMATS = ["bfloat16", "float16", "int8", "fp8"]  # every format that rounds what it stores
INT8 = KV_FORMATS["int8"]


def fp8_scales(fmt: str, hkv: int) -> torch.Tensor | None:
    """Fixed per-head scales (2, Hkv) of an fp8 cache, spread so that they matter."""
    return torch.linspace(0.5, 2.0, 2 * hkv).view(2, hkv) if fmt == "fp8" else None


def stored(fmt: str, x: torch.Tensor, head_scales: torch.Tensor | None) -> torch.Tensor:
    """x (…, Hkv, D) as `fmt`'s rows, by the registry's torch quantization."""
    return kv_format(fmt).quantize(x, head_scales)


def quantize_rows(x: torch.Tensor) -> torch.Tensor:
    return INT8.quantize(x, None)


def dequantize_rows(rows: torch.Tensor) -> torch.Tensor:
    return INT8.dequantize(rows, None)


def test_int8_round_trip_error_is_at_most_half_a_step():
    x = torch.randn(50, 3, 64) * torch.logspace(-3, 3, 50)[:, None, None]
    rows = quantize_rows(x)
    assert rows.shape == (50, 3, 68) and rows.dtype == torch.int8
    step = x.abs().amax(-1, keepdim=True) / 127
    assert bool(((dequantize_rows(rows) - x).abs() <= step / 2 + 1e-6 * step).all())
    assert torch.equal(quantize_rows(on_grid(x)), rows)  # idempotent on its own grid
    assert torch.equal(dequantize_rows(quantize_rows(torch.zeros(2, 1, 8))), torch.zeros(2, 1, 8))


def test_fp8_round_trip_error_and_saturation():
    scales = torch.tensor([1.0, 0.25, 4.0])  # per KV head
    x = torch.randn(40, 3, 64) * 10
    got = on_grid(x, FP8, scales)
    rel = ((got - x).abs() / x.abs().clamp(min=0.05 * scales.view(-1, 1))).amax()
    assert rel <= 1 / 16 + 1e-6  # e4m3: 3 mantissa bits, half a step is 1/16 relative
    assert torch.equal(on_grid(got, FP8, scales), got)
    big = torch.full((1, 3, 4), 1e6)  # past e4m3's range: saturates at 448 * scale, no NaN
    torch.testing.assert_close(on_grid(big, FP8, scales),
                               448 * scales.view(1, 3, 1).expand(1, 3, 4))


@pytest.mark.parametrize("fmt", FORMATS)
def test_store_and_block_copy_keep_values_and_scales_together(fmt):
    cache = allocate_kv_cache(2, 6, 4, 3, 16, torch.float32, torch.device("cpu"), fmt)
    assert cache.shape == ((2, 2, 6, 4, 3, 20) if fmt == "int8" else (2, 2, 6, 4, 3, 16))
    assert cache.dtype == {"int8": torch.int8, "fp8": FP8, "bfloat16": torch.bfloat16,
                           "float16": torch.float16}[fmt]
    scales = torch.tensor([[1.0, 2.0, 0.5], [4.0, 1.0, 1.0]]) if fmt == "fp8" else None
    k, v = torch.randn(3, 3, 16), torch.randn(3, 3, 16) * 100
    store_kv(cache[1], k, v, torch.tensor([5, 6, 13]), scales)  # block 1: 1, 2; block 3: 1
    values = as_float(cache[1], scales, torch.float32).view(2, -1, 3, 16)
    grid = (lambda x, i: on_grid(x, cache.dtype, None if scales is None else scales[i]))
    torch.testing.assert_close(values[1, [5, 6, 13]], grid(v, 1), rtol=0, atol=0)
    torch.testing.assert_close(values[0, [5, 6, 13]], grid(k, 0), rtol=0, atol=0)
    assert not values[:, [4, 7, 12]].any()  # other slots untouched (zero)
    copy_blocks(cache, [(1, 4)])
    assert torch.equal(cache[:, :, 4].view(torch.uint8), cache[:, :, 1].view(torch.uint8))


def _triton_store(cache, k, v, slots, scales):
    """Triton's store on its device (compiled on a GPU), written back into `cache`."""
    from tokenmill.attention import triton_kv_store

    device = kernel_device("triton")
    on_device = cache.to(device)
    triton_kv_store.store_kv(on_device, k.to(device), v.to(device), slots.to(device),
                            None if scales is None else scales.to(device))
    cache.copy_(on_device.cpu())


STORES = [pytest.param(lambda c, k, v, s, sc: cpu_ops.store_kv_(c[0], c[1], k, v, s, sc),
                       marks=needs_kernel, id="cpu"),
          pytest.param(_triton_store, marks=needs_triton, id="triton")]


@pytest.mark.parametrize("store", STORES)
@pytest.mark.parametrize("fmt", ["auto", *FORMATS])
@pytest.mark.parametrize("d", [64, 12])
def test_store_kernels_write_the_torch_bytes(store, fmt, d):
    """The C++ store and the Triton one (quantize and write in one op) against the torch ops,
    byte for byte, on strided k / v views of a qkv output (as the model gives them), with
    values from 1e-4 to 1e3 (fp8's subnormals, rounding ties and saturation included)."""
    torch.manual_seed(0)
    cache_c = allocate_kv_cache(1, 8, 4, 3, d, torch.float32, torch.device("cpu"), fmt)[0]
    cache_t = cache_c.clone()
    scales = torch.tensor([[1.0, 0.5, 3.0], [2.0, 1.0, 0.125]]) if fmt == "fp8" else None
    qkv = torch.randn(7, 9 + 6, d) * torch.logspace(-4, 3, 7)[:, None, None]
    qkv[2, 9:12] = 0  # an all-zero K row: scale 0, values 0
    qkv[3, 12, :4] = torch.tensor([0.5, 1.5, -2.5, 0.0078125 * 1.5])  # ties
    k, v = qkv[:, 9:12], qkv[:, 12:15]  # (T, Hkv, D) strided views
    slots = torch.tensor([3, 9, 4, 30, 17, 0, 22])
    store(cache_c, k, v, slots, scales)
    flat = cache_t.view(2, -1, *cache_t.shape[-2:])
    if fmt == "auto":
        flat[0, slots], flat[1, slots] = k, v
    else:
        flat[0, slots] = stored(fmt, k, None if scales is None else scales[0])
        flat[1, slots] = stored(fmt, v, None if scales is None else scales[1])
    assert torch.equal(cache_c.view(torch.uint8), cache_t.view(torch.uint8))


def test_capacity_counts_the_real_bytes():
    f32 = bytes_per_block(30, 16, 3, 64, torch.float32)
    i8 = bytes_per_block(30, 16, 3, 64, torch.float32, "int8")
    f8 = bytes_per_block(30, 16, 3, 64, torch.float32, "fp8")
    b16 = bytes_per_block(30, 16, 3, 64, torch.float32, "bfloat16")
    assert (f32, i8, f8) == (30 * 2 * 16 * 3 * 64 * 4, 30 * 2 * 16 * 3 * 68, 30 * 2 * 16 * 3 * 64)
    assert f32 == 2 * b16
    assert 3.7 < f32 / i8 < 3.8 and f32 / f8 == 4


def quantized_step(fmt, shape, seqs, shared_prefix=0, seed=0):
    """A step (test_paged_backends.build_step) whose cache holds every cached row quantized,
    with the dense reference's K/V on the cache's grid (what every path reads)."""
    bs, hq, hkv, d = shape
    cache, batch, q, k_new, v_new, full_k, full_v = build_step(
        bs, hq, hkv, d, seqs, shared_prefix=shared_prefix, seed=seed)
    scales = fp8_scales(fmt, hkv)
    k_scales, v_scales = (None, None) if scales is None else scales
    # (2, nb, bs, hkv, R): fp8 stacked as bytes (torch.stack has no float8 kernel on CPU)
    rows = [stored(fmt, cache[0], k_scales), stored(fmt, cache[1], v_scales)]
    storage = rows[0].dtype
    cache_q = torch.stack([r.view(torch.uint8) if storage == FP8 else r for r in rows])
    cache_q = cache_q.view(storage)
    full_k = [on_grid(k, storage, k_scales) for k in full_k]
    full_v = [on_grid(v, storage, v_scales) for v in full_v]
    return cache_q, scales, batch, q, k_new, v_new, full_k, full_v


def run_quantized(backend_name, bs, cache, scales, batch, q, k_new, v_new):
    return run(backend_name, bs, cache, batch, q, k_new, v_new, kv_scales=scales)


def check_against_dense(out, batch, q, full_k, full_v, d, on_tiles=False):
    """on_tiles: the kernel attended a bfloat16 cache with q and p rounded (the AMX tile unit
    or vdpbf16ps: kernel_rounds_qp)."""
    for i in range(len(batch.query_lens)):
        s, e = batch.query_start_locs[i], batch.query_start_locs[i + 1]
        assert_attention_close(out[s:e], q[s:e], full_k[i], full_v[i], d ** -0.5, on_tiles)


def kernel_rounds_qp(fmt, shape, module=None):
    """Whether the C++ kernel (the runtime build's, or `module`'s) attends this cache (shape:
    block size, Hq, Hkv, D) with q and p rounded to bfloat16."""
    d, g = shape[3], shape[1] // shape[2]
    on = module.bf16_rounds_qp(d, g) if module is not None else bf16_rounds_qp(d, g)
    return fmt == "bfloat16" and on


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("shape", [(4, 6, 2, 8), (16, 9, 3, 64), (4, 4, 2, 12)])
def test_every_backend_reads_the_quantized_cache(backend, fmt, shape):
    """A mixed step (decodes, fresh prefills, chunks over cached prefixes, short chunks, five
    decodes sharing 4 cached blocks) on a quantized cache: dense attention over the values
    the cache holds (a fresh prefill's own k/v included: they are read back as stored)."""
    bs, hq, hkv, d = shape
    seqs = MIXED + [(4 * bs + 3, 1)] * 5
    step = quantized_step(fmt, shape, seqs, shared_prefix=4 * bs)
    cache, scales, batch, q, k_new, v_new, full_k, full_v = step
    meta, out = run_quantized(backend, bs, cache, scales, batch, q, k_new, v_new)
    if backend == "cpu":  # every query went to the kernel
        assert meta.paged.seq_rows.numel() == batch.num_tokens
    check_against_dense(out, batch, q, full_k, full_v, d,
                        backend == "cpu" and kernel_rounds_qp(fmt, shape))


@needs_kernel
@pytest.mark.parametrize("shape", [(16, 4, 4, 64), (16, 4, 2, 64), (16, 8, 2, 64),
                                   (16, 10, 2, 64), (16, 12, 2, 64)])
def test_cpu_kernel_bf16_keys_transposed_for_every_group_size(shape):
    """A bfloat16 cache with 64-dim heads is scored with its keys transposed on AVX-512 builds
    (csrc/paged_attention_keys_t.h: G = 1..6 query heads per KV head, one to four vectors of
    16 keys in a tile's last part): a mixed step with prefill chunks, decodes of many lengths
    and a shared prefix, against dense attention on the values the cache holds."""
    bs = shape[0]
    seqs = MIXED + [(4 * bs + 3, 1)] * 5 + [(70 + 9 * i, 1) for i in range(8)]
    step = quantized_step("bfloat16", shape, seqs, shared_prefix=4 * bs, seed=3)
    cache, scales, batch, q, k_new, v_new, full_k, full_v = step
    _, out = run_quantized("cpu", bs, cache, scales, batch, q, k_new, v_new)
    check_against_dense(out, batch, q, full_k, full_v, shape[3],
                        kernel_rounds_qp("bfloat16", shape))


@needs_kernel
@pytest.mark.parametrize("dtype,d", [(torch.bfloat16, 64), (torch.float16, 64),
                                     (torch.float16, 128)])
@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (9, 3), (8, 2), (10, 2), (12, 2)])
def test_cpu_kernel_half_rows_alone_read_in_place_bitwise(heads, dtype, d):
    """A row that walks its keys alone (a decode) reads a bf16 cache's rows in place
    (csrc/paged_attention_keys_t.h: score_raw_t, accumulate_raw; paged_attention_raw.h for
    the other shapes), and a float16 cache's (paged_attention_raw.h); rows that walk them
    together (decodes sharing cached blocks) read a widened copy. The two must be one
    arithmetic: each row bitwise the same alone as among the others, for every group size
    G = 1..6 and tiles ending anywhere in a vector of 16 keys (head size 128: Llama's)."""
    op = paged_attention_op()
    hq, hkv = heads
    gen = torch.Generator().manual_seed(11)
    bs, nb, seqs = 16, 400, 6
    k_cache = torch.randn(nb, bs, hkv, d, generator=gen).to(dtype)
    v_cache = torch.randn(nb, bs, hkv, d, generator=gen).to(dtype)
    ids = torch.randperm(nb - 1, generator=gen).add(1)
    # 32 shared blocks (keys [0, 512): the first chunk, read once for all rows) and 12 own
    tables = torch.cat([ids[:32].repeat(seqs, 1), ids[32:32 + seqs * 12].view(seqs, 12)], 1)
    rows = torch.arange(seqs)
    lens = torch.tensor([514, 531, 583, 641, 690, 703])
    starts = torch.zeros_like(rows)
    q = torch.randn(seqs, hq, d, generator=gen)
    out, lse = op(q, k_cache, v_cache, tables, rows, starts, lens, d ** -0.5, None, 0.0, 512)
    for i in range(seqs):
        alone = op(q[i:i + 1], k_cache, v_cache, tables, rows[i:i + 1], starts[i:i + 1],
                   lens[i:i + 1], d ** -0.5, None, 0.0, 512)
        assert torch.equal(alone[0][0], out[i]) and torch.equal(alone[1][0], lse[i]), i


@needs_kernel
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("cached", [[1000], [700, 0, 90] + [40 + 7 * i for i in range(60)]])
def test_cpu_kernel_long_decodes_and_batch(fmt, cached):
    """One long decode (its keys split across threads) and a batch of 63 (whole rows per
    work item) on a quantized cache, against dense attention on the dequantized values."""
    shape = (16, 9, 3, 64)
    seqs = [(n, 1) for n in cached]
    cache, scales, batch, q, k_new, v_new, full_k, full_v = quantized_step(fmt, shape, seqs,
                                                                           seed=5)
    _, out = run_quantized("cpu", 16, cache, scales, batch, q, k_new, v_new)
    check_against_dense(out, batch, q, full_k, full_v, 64, kernel_rounds_qp(fmt, shape))


def test_bad_formats_are_refused():
    with pytest.raises(ValueError, match="fp8_e5m2.*not built"):
        CacheConfig(kv_cache_dtype="fp8_e5m2")
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        CacheConfig(kv_cache_dtype="int4")
    assert CacheConfig(kv_cache_dtype="fp8_e4m3").kv_cache_dtype == "fp8_e4m3"


def test_fp8_without_torch_support_is_refused_at_startup(monkeypatch):
    monkeypatch.delattr(torch, "float8_e4m3fn")
    with pytest.raises(ValueError, match="needs torch.float8_e4m3fn"):
        CacheConfig(kv_cache_dtype="fp8")


@needs_kernel
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("shape", [(16, 9, 3, 64), (4, 4, 2, 12)])  # D = 12: the scalar tails
def test_every_kernel_build_this_cpu_runs_reads_it(fmt, shape):
    """The kernel's AVX-512, AVX2 and portable builds (those this CPU can run) dequantize
    alike: the same decodes through each build's op, against the dense reference."""
    import importlib

    from tokenmill.utils.cpp_extension import runnable_isas

    bs, hq, hkv, d = shape
    seqs = [(n, 1) for n in (37, 5, 80, 1)]
    cache, scales, batch, q, _, _, full_k, full_v = quantized_step(fmt, shape, seqs, seed=2)
    # the new tokens' rows were not written by a forward: store them as the backends would
    for i, (c, _) in enumerate(seqs):
        store_kv(cache, full_k[i][c:], full_v[i][c:], batch.slot_mapping[i:i + 1], scales)
    for isa in runnable_isas():
        module = importlib.import_module(f"tokenmill._C.paged_attention_cpu_{isa}")
        op = module.paged_attention
        rows = torch.arange(len(seqs))
        out, _ = op(q, cache[0], cache[1], batch.block_tables, rows, torch.zeros_like(rows),
                    batch.seq_lens_t, d ** -0.5, scales)
        check_against_dense(out, batch, q, full_k, full_v, d,
                            kernel_rounds_qp(fmt, shape, module))
