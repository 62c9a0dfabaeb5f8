"""The C++ linear op's batch-invariant kernels (csrc/linear_dot.h; the row kernels for integer
activations): every row of y is bitwise the same whatever rows of x come with it (alone, a few,
a prefill chunk), for dense float32, Q8_0 and 4-bit weights, float and int8 activations, an
input scale and a bias; and close to the float64 product of the weight the blocks describe."""

from __future__ import annotations

import pytest
import torch

from tokenmill.layers import cpu_ops
from tokenmill.quantization import CPULinearKernel
from tokenmill.utils.cpp_extension import runtime_isa

pytestmark = pytest.mark.skipif(not cpu_ops.ops_available(), reason="C++ toolchain unavailable")


def _weight(kind: int, n: int, k: int, gen: torch.Generator) -> tuple[tuple, torch.Tensor]:
    """(the kernel's tensors, the float64 weight they stand for)."""
    if kind == CPULinearKernel.DENSE:
        w = torch.randn(n, k, generator=gen)
        return (w,), w.double()
    d = (torch.rand(n, k // 32, generator=gen) * 0.02).half()
    if kind == CPULinearKernel.Q8_0:
        q = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=gen)
        return (q, d), q.double() * d.double().repeat_interleave(32, 1)
    q = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=gen)
    m = (torch.randn(n, k // 32, generator=gen) * 0.02).half()
    nib = torch.cat([(q & 15).view(n, k // 32, 16), (q >> 4).view(n, k // 32, 16)], -1)
    w = nib.reshape(n, k).double() * d.double().repeat_interleave(32, 1) \
        + m.double().repeat_interleave(32, 1)
    return (q, d, m), w


KINDS = [("dense", CPULinearKernel.DENSE, False), ("q8_0", CPULinearKernel.Q8_0, False),
         ("q4", CPULinearKernel.Q4, False), ("q8_0+int8acts", CPULinearKernel.Q8_0, True),
         ("q4+int8acts", CPULinearKernel.Q4, True)]


@pytest.mark.parametrize("name,kind,int8_acts", KINDS, ids=[k[0] for k in KINDS])
@pytest.mark.parametrize("k,n", [(576, 200), (64, 37), (1536, 96)])
def test_every_row_is_the_same_at_every_step_size(name, kind, int8_acts, k, n):
    gen = torch.Generator().manual_seed(k + n)
    tensors, w64 = _weight(kind, n, k, gen)
    scale = torch.rand(k, generator=gen) + 0.5 if kind == CPULinearKernel.Q4 else None
    kernel = CPULinearKernel(kind, 32 if kind else 0, tensors, int8_acts, scale)
    bias = torch.randn(n, generator=gen)
    x = torch.randn(300, k, generator=gen)
    full = cpu_ops.linear(x, kernel, bias)
    for m in (1, 2, 3, 4, 5, 7, 12, 16, 17, 64, 129):
        for start in (0, 11, 300 - m):
            rows = x[start:start + m].contiguous()
            assert torch.equal(cpu_ops.linear(rows, kernel, bias), full[start:start + m]), (m,
                                                                                           start)
    xs = x.double() * (scale.double() if scale is not None else 1)
    want = xs @ w64.T + bias.double()
    err = ((full.double() - want).abs().max() / want.abs().max()).item()
    # int8 activations round x per 32 values; on AVX-512 VNNI builds float activations meet
    # quantized weights rounded to int16 per 32 values (2^-15 of the block's largest)
    int16_acts = kind != CPULinearKernel.DENSE and runtime_isa() == "avx512"
    assert err < (2e-2 if int8_acts else 1e-4 if int16_acts else 2e-5)


@pytest.mark.parametrize("k,n", [(576, 960), (1536, 67), (13, 5), (67, 13)])
def test_dense_rows_match_torch_at_every_m(k, n):
    """Dense weights of any width (a scalar tail past the last vector), invariant or not."""
    gen = torch.Generator().manual_seed(k)
    w, b = torch.randn(n, k, generator=gen), torch.randn(n, generator=gen)
    for invariant in (True, False):
        kernel = CPULinearKernel(CPULinearKernel.DENSE, 0, (w,), batch_invariant=invariant)
        for m in (1, 2, 4, 9, 70):
            x = torch.randn(m, k, generator=gen)
            torch.testing.assert_close(cpu_ops.linear(x, kernel, b), x @ w.T + b, atol=2e-4,
                                       rtol=1e-5)
