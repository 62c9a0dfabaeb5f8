"""Grammar bitmasks on logits: bit j of word i allows token 32 i + j, checked against a
per-token loop; only the given rows change; the sign bit and a vocabulary that is not a
multiple of 32 are handled."""

from __future__ import annotations

import pytest
import torch

from tokenmill.layers.token_bitmask import apply_token_bitmask_, unpack_bitmask


@pytest.mark.parametrize("vocab", [32, 100, 49152])
def test_unpack_matches_a_bit_loop(vocab):
    g = torch.Generator().manual_seed(vocab)
    words = (vocab + 31) // 32
    mask = torch.randint(-2**31, 2**31 - 1, (3, words), dtype=torch.int32, generator=g)
    got = unpack_bitmask(mask, vocab)
    assert got.shape == (3, vocab)
    for r in range(3):
        for t in range(0, vocab, max(1, vocab // 997)):
            assert bool(got[r, t]) == bool((int(mask[r, t // 32]) >> (t % 32)) & 1)
    assert bool(unpack_bitmask(torch.tensor([[-2**31]], dtype=torch.int32), 32)[0, 31])


def test_apply_masks_only_the_given_rows():
    logits = torch.randn(4, 70)
    before = logits.clone()
    mask = torch.zeros(2, 3, dtype=torch.int32)
    mask[0, 0] = 0b101  # tokens 0 and 2
    mask[1, 2] = 1 << 5  # token 69
    apply_token_bitmask_(logits, mask, torch.tensor([1, 3]))
    assert torch.equal(logits[[0, 2]], before[[0, 2]])
    assert torch.isfinite(logits[1]).nonzero().flatten().tolist() == [0, 2]
    assert torch.equal(logits[1, [0, 2]], before[1, [0, 2]])
    assert torch.isfinite(logits[3]).nonzero().flatten().tolist() == [69]
    with pytest.raises(ValueError, match="cover"):
        apply_token_bitmask_(torch.randn(1, 100), torch.zeros(1, 3, dtype=torch.int32),
                             torch.tensor([0]))


def test_cpu_op_equals_the_tensor_ops():
    """float32 on CPU takes the C++ op; float64 the plain tensor ops: same masking."""
    from tokenmill.layers import cpu_ops

    if not cpu_ops.ops_available():
        pytest.skip("C++ kernels not built")
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 49152, generator=g)
    mask = torch.randint(-2**31, 2**31 - 1, (3, 1536), dtype=torch.int32, generator=g)
    mask[0] = -1  # everything allowed
    mask[1, :100] = 0  # nothing in the first 3200 tokens
    rows = torch.tensor([4, 0, 2])
    fast = apply_token_bitmask_(logits.clone(), mask, rows)
    slow = apply_token_bitmask_(logits.double(), mask, rows)
    assert torch.equal(fast, slow.float())
    assert torch.equal(fast[4], logits[4]) and torch.equal(fast[[1, 3]], logits[[1, 3]])
