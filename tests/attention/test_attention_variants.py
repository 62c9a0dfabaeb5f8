"""Sliding windows and soft-capped scores (attention/base.py's FEATURES) in every backend that
lists them, against dense attention with the same mask and cap, on a mixed step (decodes,
fresh prefills, chunks over a cached prefix, in scattered blocks); and `auto` / explicit
backend choice by the variants a model's layers use."""

from __future__ import annotations

import pytest
import torch

from tests.attention.test_paged_backends import (
    BACKENDS,
    MIXED,
    build_step,
    kernel_device,
    needs_kernel,
    run,
)
from tokenmill.attention import get_attention_backend


def dense(q, k, v, scale, window, cap):
    """q (Lq, Hq, D): the last Lq positions of a sequence with full K/V k, v (L, Hkv, D)."""
    L, Lq = k.shape[0], q.shape[0]
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
    s = torch.einsum("qhd,khd->hqk", q, k) * scale
    if cap is not None:
        s = cap * torch.tanh(s / cap)
    q_pos, k_pos = torch.arange(L - Lq, L)[:, None], torch.arange(L)[None, :]
    hidden = k_pos > q_pos
    if window is not None:
        hidden |= k_pos <= q_pos - window
    return torch.einsum("hqk,khd->qhd", s.masked_fill(hidden, float("-inf")).softmax(-1), v)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("window, cap", [(5, None), (None, 2.0), (9, 1.5), (1, None)])
def test_variants_match_dense(backend, window, cap):
    features = frozenset({"sliding_window"} if window else set()) | (
        frozenset({"soft_cap"}) if cap else frozenset())
    backend_cls = type(get_attention_backend(backend, 4, kernel_device(backend)))
    if not features <= backend_cls.FEATURES:
        with pytest.raises(ValueError, match="does not compute"):
            get_attention_backend(backend, 4, kernel_device(backend), features=features)
        return
    bs, hq, hkv, d = 4, 6, 2, 16
    cache, batch, q, k_new, v_new, full_k, full_v = build_step(bs, hq, hkv, d, MIXED)
    _, out = run(backend, bs, cache, batch, q, k_new, v_new, features=features,
                 sliding_window=window, soft_cap=cap)
    for i in range(len(MIXED)):
        s, e = batch.query_start_locs[i], batch.query_start_locs[i + 1]
        want = dense(q[s:e], full_k[i], full_v[i], d ** -0.5, window, cap)
        torch.testing.assert_close(out[s:e], want, rtol=0, atol=1e-5)


@needs_kernel
def test_auto_picks_a_backend_computing_the_model_s_variants():
    cpu = torch.device("cpu")
    assert type(get_attention_backend("auto", 4, cpu)).__name__ == "CPUPagedAttention"
    windowed = get_attention_backend("auto", 4, cpu, features=frozenset({"sliding_window"}))
    assert type(windowed).__name__ == "CPUPagedAttention"
    capped = get_attention_backend("auto", 4, cpu, features=frozenset({"soft_cap"}))
    assert type(capped).__name__ == "CPUPagedAttention"
    # on CUDA without triton, or with float16 on CPU: the PyTorch backend computes both
    half = get_attention_backend("auto", 4, cpu, torch.float16,
                                 features=frozenset({"soft_cap", "sliding_window"}))
    assert type(half).__name__ == "TorchPagedAttention"
    # asked for by name, the C++ kernel refuses what it does not compute (float32 on CPU)
    with pytest.raises(ValueError, match="computes float32 on CPU, not torch.bfloat16"):
        get_attention_backend("cpu", 4, cpu, torch.bfloat16)


def test_every_backend_takes_the_layer_not_its_variants():
    """The interface does not widen with a variant: each backend's forward takes the layer
    (its AttentionVariant and kv_scales fixed when it was built) and the step's tensors."""
    import inspect

    from tokenmill.attention.registry import _REGISTRY, _backend_class

    for name in _REGISTRY:
        params = list(inspect.signature(_backend_class(name).forward).parameters)
        assert params == ["self", "layer", "q", "k", "v", "kv_cache", "meta"], name
