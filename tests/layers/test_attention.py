"""The attention layer's key rotation (a quantized cache stores keys rotated by a fixed
orthonormal R, queries rotated alike): exact before rounding, and what it is for, smaller
int8 errors on keys whose outlier channels would otherwise set every row's step."""

from __future__ import annotations

import pytest
import torch

from tests.attention.test_paged_backends import MIXED, build_step
from tokenmill.attention import get_attention_backend
from tokenmill.attention.kv_cache import key_rotation, on_grid
from tokenmill.layers.attention import Attention


@pytest.mark.parametrize("d", [64, 16, 12, 80])  # powers of two: Hadamard; else seeded QR
def test_rotation_is_orthonormal_and_only_for_quantized_caches(d):
    r = key_rotation(d, "int8", torch.device("cpu"))
    torch.testing.assert_close(r @ r.T, torch.eye(d), atol=1e-6, rtol=0)
    assert torch.equal(key_rotation(d, "fp8", torch.device("cpu")), r)  # fixed, not drawn
    assert key_rotation(d, "auto", torch.device("cpu")) is None


def test_rotated_layer_attends_as_the_plain_one():
    """The same step through the layer on a float32 cache, with and without the rotation:
    the same output to float32 rounding (scores are invariant; the cache holds k R)."""
    bs, hq, hkv, d = 16, 9, 3, 64
    cache, batch, q, k_new, v_new, _, _ = build_step(bs, hq, hkv, d, MIXED)
    outs = []
    for rotation in (None, key_rotation(d, "int8", torch.device("cpu"))):
        layer = Attention(hq, hkv, d, d ** -0.5)
        backend = get_attention_backend("torch", bs, torch.device("cpu"))
        layer_cache = cache.clone()
        if rotation is not None:  # earlier steps stored their keys through the same layer
            layer_cache[0] = layer_cache[0] @ rotation
        layer.bind(layer_cache, backend, None, rotation)
        outs.append(layer(q, k_new, v_new, backend.build_metadata(batch)))
    torch.testing.assert_close(outs[1], outs[0], atol=1e-5, rtol=1e-5)


def test_rotation_shrinks_int8_score_error_of_outlier_channels():
    """Keys with two outlier channels (as SmolLM2's: max 22.5, median 1.0): the int8 grid's
    error on q . k is several times smaller for rotated keys."""
    torch.manual_seed(0)
    k, q = torch.randn(256, 3, 64), torch.randn(256, 3, 64)
    k[..., 5] *= 20
    k[..., 37] *= 15
    r = key_rotation(64, "int8", torch.device("cpu"))
    exact = (q * k).sum(-1)
    plain = (q * on_grid(k)).sum(-1)
    rotated = ((q @ r) * on_grid(k @ r)).sum(-1)
    err_plain, err_rotated = (plain - exact).abs().mean(), (rotated - exact).abs().mean()
    assert err_rotated < err_plain / 3, (err_plain, err_rotated)
