"""attention/triton_kv_store.py's RoPE + KV-cache store against what it fuses: q rotated as
layers/rotary.py's torch code rotates it, bit for bit, and the cache bytes the torch ops write
for the rotated k and for v, in every KV format (the store alone: test_kv_cache_quantized.py).

Compiled on a GPU (benchmarks/gpu_session.sh: bfloat16 heads too), in Triton's interpreter on
CPU tensors elsewhere (float32 and float16 heads: the interpreter's bfloat16 cast truncates).
Operands are strided views of one qkv output, as models pass them; half-rotated heads, a head
size that is not a power of two, grouped and multi-head attention, and an empty step."""

from __future__ import annotations

import pytest
import torch

from tests.attention.test_paged_backends import kernel_device, needs_triton
from tokenmill.attention.kv_cache import allocate_kv_cache
from tokenmill.attention.kv_formats import kv_format
from tokenmill.layers.rotary import _table

pytestmark = needs_triton

DEVICE = kernel_device("triton")
HEAD_DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE.type == "cuda"
                                                else [])


def torch_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Hugging Face's rotate_half RoPE over the first R features (torch's roundings)."""
    R = cos.shape[-1]
    x1, x2 = x[..., :R // 2], x[..., R // 2:R]
    rotated = x[..., :R] * cos + torch.cat((-x2, x1), dim=-1) * sin
    return torch.cat([rotated, x[..., R:]], dim=-1)


def step(tokens: int, hq: int, hkv: int, d: int, r: int, dtype: torch.dtype):
    """qkv (T, (Hq + 2 Hkv) D) and its q, k, v views; cos, sin (T, 1, R) at spread positions."""
    g = torch.Generator().manual_seed(hq * d + tokens)
    qkv = (torch.randn(tokens, (hq + 2 * hkv) * d, generator=g) * 4).to(DEVICE, dtype)
    q = qkv[:, :hq * d].view(tokens, hq, d)
    k = qkv[:, hq * d:(hq + hkv) * d].view(tokens, hkv, d)
    v = qkv[:, (hq + hkv) * d:].view(tokens, hkv, d)
    positions = torch.tensor([0, 1, 5, 17, 300, 4095, 9][:tokens], dtype=torch.float32)
    cos, sin = _table(1.0 / 10000 ** (torch.arange(0, r, 2).float() / r), 1.0, positions)
    cos, sin = (t.unsqueeze(1).to(DEVICE, dtype) for t in (cos, sin))
    return qkv, q, k, v, cos, sin


@pytest.mark.parametrize("fmt", ["auto", "bfloat16", "float16", "int8", "fp8"])
@pytest.mark.parametrize("dtype", HEAD_DTYPES)
@pytest.mark.parametrize("tokens, hq, hkv, d, r", [(1, 4, 2, 64, 64), (7, 9, 3, 80, 80),
                                                   (3, 8, 8, 96, 48), (0, 4, 2, 64, 64)])
def test_rotary_store_writes_what_rotary_then_store_write(fmt, dtype, tokens, hq, hkv, d, r):
    from tokenmill.attention.triton_kv_store import rotary_store_kv

    qkv, q, k, v, cos, sin = step(tokens, hq, hkv, d, r, dtype)
    scales = (torch.linspace(0.5, 2.0, 2 * hkv).view(2, hkv).to(DEVICE) if fmt == "fp8"
              else None)
    cache = allocate_kv_cache(1, 8, 4, hkv, d, dtype, DEVICE, fmt)[0]
    slots = torch.tensor([3, 9, 4, 30, 17, 0, 22][:tokens], dtype=torch.long, device=DEVICE)
    want_q, want_k = torch_rotary(q, cos, sin), torch_rotary(k, cos, sin)
    want_cache = cache.clone()
    flat = want_cache.view(2, -1, *cache.shape[-2:])
    for i, x in enumerate((want_k, v)):
        rows = x if fmt == "auto" else kv_format(fmt).quantize(
            x.cpu(), None if scales is None else scales[i].cpu()).to(DEVICE)
        flat[i, slots] = rows
    k_before, v_before = k.clone(), v.clone()

    rotary_store_kv(q, k, v, cos, sin, cache, slots, scales)

    assert torch.equal(q, want_q)  # rotated in place, the same roundings
    assert torch.equal(cache.view(torch.uint8), want_cache.view(torch.uint8))
    assert torch.equal(k, k_before) and torch.equal(v, v_before)  # read, never written
    assert qkv.data_ptr() == q.data_ptr()  # q rotated where the projection wrote it


def test_the_backend_takes_rope_only_where_the_operands_fit():
    """fuses_rotary: unit-stride heads and one table layout; else the layer rotates first."""
    from tokenmill.attention.triton_paged import TritonPagedAttention

    backend = TritonPagedAttention(4, DEVICE)
    _, q, k, _, cos, sin = step(3, 4, 2, 64, 64, torch.float32)
    assert backend.fuses_rotary(q, k, cos, sin)
    assert not backend.fuses_rotary(q.transpose(1, 2).contiguous().transpose(1, 2), k, cos,
                                    sin)
    assert not backend.fuses_rotary(q, k, cos, torch.cat([sin, sin], -1)[..., :64])
