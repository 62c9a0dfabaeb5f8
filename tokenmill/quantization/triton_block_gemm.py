"""The block-quantized weights (quantization/blocks.py's Q8_0 and Q4 layouts) multiplied on CUDA
by one Triton GEMM: int8, int4, AWQ and GPTQ checkpoints run there through the same method
objects and the same stored blocks as on CPU. Block-scaled fp8 checkpoints (e4m3 weights with
one scale per 128 x 128 tile: quantization/fp8.py) take the same kernel (`fp8_block_linear`).

One program computes a BM x BN tile of C = (x * input_scale) @ W^T (+ bias): the K loop walks
one 32-weight block at a time, loads the tile's BN rows of that block (Q8_0: 32 int8 values;
Q4: 16 bytes, weight j in the low nibble of byte j and weight j + 16 in the high one, as
llama.cpp orders them), dequantizes them in registers (d q, or d q + m with the block's group's
scale and offset) to the activations' dtype and accumulates the products in float32 (float32
activations: IEEE products, no TF32). The weight is read once per BM rows of x, never expanded
in memory.

Invariants: q, d, m are the layer's contiguous parameters; K is a multiple of 32 and of the
group G (the formats' own rule). BM grows with M (a prefill's tiles dequantize the weight fewer
times), and tensor cores may sum a tile's products in another order at another BM, so results
are not claimed batch-invariant on the GPU (EngineConfig.batch_invariant is off on CUDA).
Runs on CPU tensors under TRITON_INTERPRET=1 (tests/quantization/test_triton_block_gemm.py
checks it against blocks.dequantize, the reference every kernel is tested against).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenmill.attention.triton_kernels import e4m3_to_float32
from tokenmill.quantization.base import CPULinearKernel

BLOCK = 32


@triton.jit
def _block_gemm_kernel(x_ptr, q_ptr, d_ptr, m_ptr, s_ptr, bias_ptr, c_ptr, M, N, K,
                       stride_xm, stride_qn, stride_dn, stride_cm,
                       GROUP: tl.constexpr, Q4: tl.constexpr, HAS_SCALE: tl.constexpr,
                       HAS_BIAS: tl.constexpr, PRECISION: tl.constexpr,
                       BM: tl.constexpr, BN: tl.constexpr, FP8: tl.constexpr = False,
                       SCALE_ROWS: tl.constexpr = 1):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    m_ok, n_ok = rm < M, rn < N
    j = tl.arange(0, 32)  # the weight's index in its block
    acc = tl.zeros((BM, BN), tl.float32)
    for k0 in range(0, K, 32):
        x = tl.load(x_ptr + rm[:, None].to(tl.int64) * stride_xm + (k0 + j)[None, :],
                    mask=m_ok[:, None], other=0.0)  # (BM, 32)
        if HAS_SCALE:  # activation-aware weights hold W s: x / s first (the kernel's 1 / s)
            x = (x.to(tl.float32) * tl.load(s_ptr + k0 + j)[None, :]).to(x.dtype)
        rows = rn[:, None].to(tl.int64) * stride_qn
        g = k0 // GROUP
        d = tl.load(d_ptr + (rn // SCALE_ROWS).to(tl.int64) * stride_dn + g, mask=n_ok,
                    other=0.0)
        d = d.to(tl.float32)[:, None]
        if FP8:  # e4m3 bytes, decoded exactly
            u = tl.load(q_ptr + rows + (k0 + j)[None, :], mask=n_ok[:, None], other=0)
            w = e4m3_to_float32(u.to(tl.int32)) * d
        elif Q4:
            byte = tl.load(q_ptr + rows + (k0 // 2 + j % 16)[None, :], mask=n_ok[:, None],
                           other=0).to(tl.int32)
            val = (byte >> ((j // 16) * 4)[None, :]) & 0xF
            m = tl.load(m_ptr + rn.to(tl.int64) * stride_dn + g, mask=n_ok, other=0.0)
            w = val.to(tl.float32) * d + m.to(tl.float32)[:, None]
        else:
            q = tl.load(q_ptr + rows + (k0 + j)[None, :], mask=n_ok[:, None], other=0)
            w = q.to(tl.float32) * d
        acc += tl.dot(x, tl.trans(w.to(x.dtype)), input_precision=PRECISION)  # (BM, BN)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(c_ptr + rm[:, None].to(tl.int64) * stride_cm + rn[None, :],
             acc.to(c_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def block_linear(x: torch.Tensor, kind: int, group: int, q: torch.Tensor, d: torch.Tensor,
                 m: torch.Tensor | None = None, input_scale: torch.Tensor | None = None,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
    """x (M, K) @ W^T (+ bias) → (M, N) in x's dtype, W the blocks of `kind` (Q8_0: q (N, K)
    int8, d (N, K/32); Q4: q (N, K/2) uint8, d, m (N, K/G)); input_scale (K,): x is multiplied
    by it first."""
    assert kind in (CPULinearKernel.Q8_0, CPULinearKernel.Q4), kind
    q4 = kind == CPULinearKernel.Q4
    return _launch(x, q, d, m, input_scale, bias, group=group if q4 else BLOCK, Q4=q4)


def fp8_block_linear(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor,
                     block: tuple[int, int], bias: torch.Tensor | None = None) -> torch.Tensor:
    """x (M, K) @ (w * scale)^T (+ bias) → (M, N) in x's dtype: w (N, K) float8 e4m3 with one
    float32 scale per (block[0] x block[1]) tile of it, scale (cdiv(N, b0), cdiv(K, b1)) (the
    checkpoints' `weight_scale_inv`); block[1] a multiple of 32."""
    assert block[1] % BLOCK == 0
    return _launch(x, w.view(torch.uint8), scale.contiguous(), None, None, bias,
                   group=block[1], FP8=True, SCALE_ROWS=block[0])


def _launch(x: torch.Tensor, q: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None,
            input_scale: torch.Tensor | None, bias: torch.Tensor | None, group: int,
            **modes: object) -> torch.Tensor:
    """The kernel over x (M, K) and a weight of q.shape[0] rows (`modes`: the kernel's Q4 /
    FP8 / SCALE_ROWS); tiles of BM rows growing with M, BN = 64."""
    M, K = x.shape
    N = q.shape[0]
    assert K % BLOCK == 0 and K % group == 0 and q.is_contiguous() and d.is_contiguous()
    x = x if x.stride(-1) == 1 else x.contiguous()
    out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if M == 0:
        return out
    bm = 16 if M <= 16 else 32 if M <= 64 else 64
    modes = {"Q4": False, **modes}
    _block_gemm_kernel[(triton.cdiv(M, bm), triton.cdiv(N, 64))](
        x, q, d, m if m is not None else d, input_scale if input_scale is not None else d,
        bias if bias is not None else d, out, M, N, K, x.stride(0), q.stride(0), d.stride(0),
        out.stride(0), GROUP=group, HAS_SCALE=input_scale is not None,
        HAS_BIAS=bias is not None, PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        BM=bm, BN=64, **modes)
    return out
