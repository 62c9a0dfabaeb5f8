"""oneDNN-prepacked linear layers: same results as F.linear (float32, summation order aside) for
every batch size (the small ones go through the C++ small-M kernel when it is built), bias
handled; the dense copy is freed unless that kernel reads it or the LM head is tied."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tokenmill.layers.cpu_gemm import onednn_available, prepack_model
from tokenmill.layers.cpu_ops import ops_available
from tokenmill.layers.linear import QKVParallelLinear, RowParallelLinear
from tokenmill.layers.vocab_embedding import ParallelLMHead

pytestmark = pytest.mark.skipif(not onednn_available(torch.device("cpu"), torch.float32),
                                reason="oneDNN unavailable")


@pytest.mark.parametrize("rows", [0, 1, 3, 64, 300])
def test_packed_linear_matches_f_linear(rows):
    torch.manual_seed(rows)
    qkv = QKVParallelLinear(96, 16, 4, 2, bias=True)
    row = RowParallelLinear(64, 96, bias=True)
    for layer in (qkv, row):
        torch.nn.init.normal_(layer.weight)
        torch.nn.init.normal_(layer.bias)
    dense = {id(m): (m.weight.clone(), m.bias.clone()) for m in (qkv, row)}
    assert prepack_model(torch.nn.ModuleList([qkv, row])) == 2
    for layer, n_in in ((qkv, 96), (row, 64)):
        assert layer.packed_weight is not None
        assert hasattr(layer, "weight") == ops_available()
        x = torch.randn(rows, n_in)
        w, b = dense[id(layer)]
        torch.testing.assert_close(layer(x), F.linear(x, w, b), atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("tied", [True, False])
def test_lm_head_prepack_keeps_a_tied_table(tied):
    head = ParallelLMHead(1000, 32)
    torch.nn.init.normal_(head.weight)
    table = head.weight.clone()
    head.tied = tied
    head.prepack()
    assert hasattr(head, "weight") == (tied or ops_available())
    hidden = torch.randn(5, 32)
    idx = torch.tensor([4, 0, 2])
    torch.testing.assert_close(head.compute_logits(hidden, idx), hidden[idx] @ table.T,
                               atol=1e-4, rtol=1e-5)
