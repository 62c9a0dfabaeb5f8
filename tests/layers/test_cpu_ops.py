"""The fused C++ CPU ops (layers/cpu_ops.py) against the PyTorch code they replace, and the
layers' choice of path: float32 results equal up to summation order."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tokenmill.layers import cpu_ops
from tokenmill.layers.activation import SiluAndMul
from tokenmill.layers.layernorm import RMSNorm
from tokenmill.layers.linear import MergedColumnParallelLinear
from tokenmill.layers.rotary import _rotate_half, apply_rotary
from tokenmill.layers.vocab_embedding import ParallelLMHead
from tokenmill.quantization import CPULinearKernel, UnquantizedConfig

pytestmark = pytest.mark.skipif(not cpu_ops.ops_available(), reason="C++ toolchain unavailable")


def dense(w: torch.Tensor) -> CPULinearKernel:
    return CPULinearKernel(CPULinearKernel.DENSE, 0, (w,))


@pytest.mark.parametrize("m", [1, 2, 3, 4])
@pytest.mark.parametrize("k,n", [(576, 960), (1536, 67), (13, 5)])
@pytest.mark.parametrize("bias", [False, True])
def test_dense_linear_matches_f_linear(m, k, n, bias):
    torch.manual_seed(m * 1000 + k + n)
    x, w = torch.randn(m, k), torch.randn(n, k)
    b = torch.randn(n) if bias else None
    torch.testing.assert_close(cpu_ops.linear(x, dense(w), b), F.linear(x, w, b),
                               atol=2e-4, rtol=1e-5)


@pytest.mark.parametrize("rows", [1, 4, 5, 33])
@pytest.mark.parametrize("invariant", [True, False])
def test_linear_layer_takes_the_c_kernel_and_agrees(rows, invariant, monkeypatch):
    """Batch-invariant layers multiply through the C++ op at every M; otherwise only small
    steps do (larger ones take oneDNN's prepacked copy)."""
    torch.manual_seed(rows)
    layer = MergedColumnParallelLinear(40, [24, 24], bias=True, quant_config=UnquantizedConfig(
        batch_invariant=invariant))
    torch.nn.init.normal_(layer.weight)
    torch.nn.init.normal_(layer.bias)
    calls = []
    real = cpu_ops.linear
    monkeypatch.setattr(cpu_ops, "linear", lambda *a: calls.append(1) or real(*a))
    x = torch.randn(rows, 40)
    torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias),
                               atol=1e-4, rtol=1e-5)
    assert len(calls) == (1 if rows <= cpu_ops.SMALL_M or invariant else 0)


def test_lm_head_decode_logits():
    head = ParallelLMHead(1000, 32)
    torch.nn.init.normal_(head.weight)
    hidden = torch.randn(6, 32)
    for idx in (torch.tensor([5]), torch.tensor([4, 0, 2, 1]), torch.arange(6)):
        torch.testing.assert_close(head.compute_logits(hidden, idx), hidden[idx] @ head.weight.T,
                                   atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("shape", [(1, 576), (7, 64), (3, 2, 37)])
def test_add_rms_norm(shape):
    torch.manual_seed(len(shape))
    norm = RMSNorm(shape[-1], eps=1e-5)
    torch.nn.init.normal_(norm.weight)
    x, res = torch.randn(shape), torch.randn(shape)
    out, summed = norm(x, res)
    torch.testing.assert_close(summed, x + res, atol=0, rtol=0)
    ref = norm.weight * ((x + res) * torch.rsqrt((x + res).pow(2).mean(-1, keepdim=True) + 1e-5))
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("shape", [(1, 2 * 1536), (5, 2 * 13), (2, 3, 2 * 40)])
def test_silu_and_mul(shape):
    x = torch.randn(shape) * 4
    gate, up = x.chunk(2, dim=-1)
    torch.testing.assert_close(SiluAndMul()(x), F.silu(gate) * up, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("head_dim", [64, 12])
def test_rotary_in_place_on_fused_qkv_views(head_dim):
    """q and k are strided views of one qkv row, as the attention layer passes them."""
    T, Hq, Hkv, D = 5, 6, 2, head_dim
    qkv = torch.randn(T, (Hq + 2 * Hkv) * D)
    q, k, v = qkv.split([Hq * D, Hkv * D, Hkv * D], dim=-1)
    q, k = q.view(T, Hq, D), k.view(T, Hkv, D)
    cos, sin = torch.randn(T, 1, D), torch.randn(T, 1, D)
    want_q, want_k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
    v_before = v.clone()
    got_q, got_k = apply_rotary(q, k, cos, sin)
    torch.testing.assert_close(got_q, want_q, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_k, want_k, atol=1e-5, rtol=1e-5)
    assert torch.equal(v, v_before)  # the op touched q and k only


@pytest.mark.parametrize("tokens", [1, 3, 300])  # 300: several threads' ranges
def test_store_kv_writes_exactly_the_slots_of_qkv_views(tokens):
    from tokenmill.attention.kv_cache import store_kv

    torch.manual_seed(tokens)
    nb, bs, hkv, d, hq = 40, 16, 3, 8, 9
    qkv = torch.randn(tokens, (hq + 2 * hkv) * d)
    k = qkv[:, hq * d:(hq + hkv) * d].view(tokens, hkv, d)  # strided rows, as in the layer
    v = qkv[:, (hq + hkv) * d:].view(tokens, hkv, d)
    slots = torch.randperm(nb * bs)[:tokens]
    cache = torch.full((2, nb, bs, hkv, d), 7.0)
    expected = cache.clone()
    flat = expected.view(2, -1, hkv, d)
    flat[0].index_copy_(0, slots, k)
    flat[1].index_copy_(0, slots, v)
    store_kv(cache, k, v, slots)  # takes the C++ op
    assert torch.equal(cache, expected)  # the slots written, nothing else touched
    with pytest.raises(RuntimeError, match="slot out of range"):
        cpu_ops.store_kv_(cache[0], cache[1], k, v, torch.full((tokens,), nb * bs))


@pytest.mark.parametrize("shape", [(1, 49152), (64, 49152), (3, 37), (2, 1)])
def test_argmax_matches_torch(shape):
    torch.manual_seed(shape[0] + shape[1])
    x = torch.randn(shape)
    assert torch.equal(cpu_ops._ops().argmax_rows(x), x.argmax(dim=-1))
    assert torch.equal(cpu_ops.argmax(x), x.argmax(dim=-1))


def test_argmax_ties_infinities_and_nan_as_torch():
    x = torch.zeros(6, 40)
    x[0, [7, 21, 39]] = 5.0  # ties: the first one
    x[1] = float("-inf")  # every token banned: index 0
    x[2, 30:] = float("inf")
    x[3, [9, 33]] = float("nan")  # torch returns the first NaN
    x[4, 38] = float("nan")  # a NaN in the scalar tail after the vector part
    x[4, 3] = 100.0
    x[5, 39] = 1.0  # the maximum in the tail
    expected = x.argmax(dim=-1)
    assert expected.tolist() == [7, 0, 30, 9, 38, 39]
    assert torch.equal(cpu_ops.argmax(x), expected)
