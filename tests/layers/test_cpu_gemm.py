"""oneDNN-prepacked linear layers (the unquantized method's large-M path without batch
invariance): same results as F.linear (float32, summation order aside) for every batch size
(the small ones go through the C++ kernel when it is built), bias handled; the dense copy is
freed unless a kernel or an embedding lookup reads it; with prepacking off, or batch-invariant
(whose kernels read the weight as stored), no copy is made."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tokenmill.layers.cpu_gemm import onednn_available
from tokenmill.layers.cpu_ops import ops_available
from tokenmill.layers.linear import QKVParallelLinear, RowParallelLinear
from tokenmill.layers.vocab_embedding import ParallelLMHead, VocabParallelEmbedding
from tokenmill.quantization import UnquantizedConfig

pytestmark = pytest.mark.skipif(not onednn_available(torch.device("cpu"), torch.float32),
                                reason="oneDNN unavailable")


PACKED = UnquantizedConfig(prepack=True, batch_invariant=False)


def process(*layers: torch.nn.Module) -> None:
    for layer in layers:
        layer.quant_method.process_weights_after_loading(layer)


@pytest.mark.parametrize("rows", [0, 1, 3, 64, 300])
def test_packed_linear_matches_f_linear(rows):
    torch.manual_seed(rows)
    qkv = QKVParallelLinear(96, 16, 4, 2, bias=True, quant_config=PACKED)
    row = RowParallelLinear(64, 96, bias=True, quant_config=PACKED)
    for layer in (qkv, row):
        torch.nn.init.normal_(layer.weight)
        torch.nn.init.normal_(layer.bias)
    dense = {id(m): (m.weight.clone(), m.bias.clone()) for m in (qkv, row)}
    process(qkv, row)
    for layer, n_in in ((qkv, 96), (row, 64)):
        assert layer.packed_weight is not None
        assert hasattr(layer, "weight") == ops_available()
        x = torch.randn(rows, n_in)
        w, b = dense[id(layer)]
        torch.testing.assert_close(layer(x), F.linear(x, w, b), atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("config", [UnquantizedConfig(prepack=False, batch_invariant=False),
                                    UnquantizedConfig(prepack=True, batch_invariant=True)])
def test_no_prepack_keeps_one_copy(config):
    layer = RowParallelLinear(64, 96, quant_config=config)
    torch.nn.init.normal_(layer.weight)
    process(layer)
    assert layer.packed_weight is None and layer.weight is not None
    x = torch.randn(9, 64)
    torch.testing.assert_close(layer(x), x @ layer.weight.T, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("tied", [True, False])
def test_lm_head_prepack_keeps_a_tied_table(tied):
    embed = VocabParallelEmbedding(1000, 32, quant_config=PACKED)
    head = ParallelLMHead(1000, 32, quant_config=PACKED)
    owner = embed if tied else head
    if tied:
        head.tie_to(embed)
    torch.nn.init.normal_(owner.weight)
    table = owner.weight.clone()
    process(embed, *([] if tied else [head]))
    assert embed.packed_weight is not None if tied else embed.packed_weight is None
    assert hasattr(owner, "weight") == (tied or ops_available())
    hidden = torch.randn(5, 32)
    idx = torch.tensor([4, 0, 2])
    torch.testing.assert_close(head.compute_logits(hidden, idx), hidden[idx] @ table.T,
                               atol=1e-4, rtol=1e-5)
    if tied:
        torch.testing.assert_close(embed(torch.tensor([3, 999])), table[[3, 999]])
