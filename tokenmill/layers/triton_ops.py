"""Fused Triton ops for the layers on CUDA: residual add + RMSNorm, gated activations
(act(gate) * up) and in-place RoPE, one launch each where PyTorch takes three to twelve.

They are what layers/cpu_ops.py is on CPU: the layers call them for a CUDA tensor when Triton
is installed (layers/cuda_ops.py) and their PyTorch code otherwise. Each kernel computes what the
module's PyTorch code computes, in its rounding order: a half-precision input is widened to
float32 for the arithmetic and rounded back to its dtype at each point where the PyTorch code
produces a tensor of that dtype (RMSNorm: the normalised row rounded before the weight
multiplies it, as Hugging Face's; RoPE: q * cos and rotate_half(q) * sin each rounded before
their sum). So bfloat16 / float16 results equal PyTorch's up to the last bit of a transcendental
(exp, erf, rsqrt), and float32 ones to float32 rounding (the row sum's order). Gemma's
(1 + weight) RMSNorm applies its weight in float32 before its one rounding, as its module does.

Every kernel works on one row (a token) at a time, so a row's result never depends on the
others in the batch (batch-invariant). The same functions run on CPU tensors under
TRITON_INTERPRET=1, which is how tests/layers/test_triton_ops.py checks them without a GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_ACTS = {"silu": 0, "gelu": 1, "gelu_tanh": 2}


@triton.jit
def _add_rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, sum_ptr, stride_x, stride_r,
                         stride_o, stride_s, eps, H: tl.constexpr, BLOCK: tl.constexpr,
                         HAS_RES: tl.constexpr, UNIT_OFFSET: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < H
    x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0)
    if HAS_RES:  # x + residual in the input's dtype, as PyTorch adds them
        x = (x.to(tl.float32) + tl.load(res_ptr + row * stride_r + cols, mask=ok,
                                        other=0.0).to(tl.float32)).to(x.dtype)
        tl.store(sum_ptr + row * stride_s + cols, x, mask=ok)
    x32 = x.to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(x32 * x32, axis=0) / H + eps)
    w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    if UNIT_OFFSET:  # Gemma: x / rms(x) * (1 + w) in float32, rounded once
        out = (x32 * inv * (1.0 + w)).to(out_ptr.dtype.element_ty)
    else:  # the normalised row rounded before the weight, as Hugging Face's Llama
        out = ((x32 * inv).to(x.dtype).to(tl.float32) * w).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * stride_o + cols, out, mask=ok)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None, unit_offset: bool = False
             ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm of x (T, H) (of x + residual, also returned, when residual is given);
    unit_offset: scaled by (1 + weight), Gemma's."""
    T, H = x.shape
    out = torch.empty_like(x)
    total = torch.empty_like(x) if residual is not None else out
    if T:
        res = residual if residual is not None else x
        _add_rms_norm_kernel[(T,)](x, res, weight, out, total, x.stride(0), res.stride(0),
                                   out.stride(0), total.stride(0), eps, H=H,
                                   BLOCK=triton.next_power_of_2(H),
                                   HAS_RES=residual is not None, UNIT_OFFSET=unit_offset)
    return out if residual is None else (out, total)


@triton.jit
def _tanh(x):
    return 2.0 * tl.sigmoid(2.0 * x) - 1.0


@triton.jit
def _gated_act_kernel(x_ptr, out_ptr, stride_x, stride_o, inter, ACT: tl.constexpr,
                      BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < inter
    gate = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0)
    up = tl.load(x_ptr + row * stride_x + inter + cols, mask=ok, other=0.0)
    g = gate.to(tl.float32)
    if ACT == 0:  # SiLU
        a = g / (1.0 + tl.exp(-g))
    elif ACT == 1:  # GELU, exact
        a = 0.5 * g * (1.0 + tl.math.erf(g * 0.7071067811865476))
    else:  # GELU, tanh approximation
        a = 0.5 * g * (1.0 + _tanh(0.7978845608028654 * (g + 0.044715 * g * g * g)))
    a = a.to(gate.dtype)  # act(gate) is a tensor of x's dtype before the product
    out = (a.to(tl.float32) * up.to(tl.float32)).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * stride_o + cols, out, mask=ok)


def gated_act(x: torch.Tensor, act: str) -> torch.Tensor:
    """x = [gate | up] (T, 2I) → act(gate) * up (T, I); act: silu, gelu or gelu_tanh."""
    T, two_i = x.shape
    inter = two_i // 2
    out = torch.empty(T, inter, dtype=x.dtype, device=x.device)
    block = min(1024, triton.next_power_of_2(inter))
    if T:
        _gated_act_kernel[(T, triton.cdiv(inter, block))](x, out, x.stride(0), out.stride(0),
                                                          inter, ACT=_ACTS[act], BLOCK=block)
    return out


@triton.jit
def _rotary_kernel(q_ptr, k_ptr, cos_ptr, sin_ptr, stride_qt, stride_qh, stride_kt,
                   stride_kh, stride_ct, HQ: tl.constexpr, HALF: tl.constexpr,
                   BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    if h < HQ:
        ptr = q_ptr + t * stride_qt + h * stride_qh
    else:
        ptr = k_ptr + t * stride_kt + (h - HQ) * stride_kh
    i = tl.arange(0, BLOCK)
    ok = i < HALF
    x1 = tl.load(ptr + i, mask=ok, other=0.0)
    x2 = tl.load(ptr + HALF + i, mask=ok, other=0.0)
    c1 = tl.load(cos_ptr + t * stride_ct + i, mask=ok, other=0.0).to(tl.float32)
    c2 = tl.load(cos_ptr + t * stride_ct + HALF + i, mask=ok, other=0.0).to(tl.float32)
    s1 = tl.load(sin_ptr + t * stride_ct + i, mask=ok, other=0.0).to(tl.float32)
    s2 = tl.load(sin_ptr + t * stride_ct + HALF + i, mask=ok, other=0.0).to(tl.float32)
    a1, a2 = x1.to(tl.float32), x2.to(tl.float32)
    # q * cos + rotate_half(q) * sin, each product rounded to the dtype before the sum
    dt = x1.dtype
    y1 = ((a1 * c1).to(dt).to(tl.float32) + (-a2 * s1).to(dt).to(tl.float32)).to(dt)
    y2 = ((a2 * c2).to(dt).to(tl.float32) + (a1 * s2).to(dt).to(tl.float32)).to(dt)
    tl.store(ptr + i, y1, mask=ok)
    tl.store(ptr + HALF + i, y2, mask=ok)


def rotary_(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Rotate the first R features of every head of q (T, Hq, D) and k (T, Hkv, D) in place by
    cos / sin (T, 1, R) (rotate_half convention; the features past R are left as they are)."""
    T, Hq, _ = q.shape
    R = cos.shape[-1]
    assert q.stride(-1) == 1 and k.stride(-1) == 1 and cos.stride(-1) == 1
    assert cos.stride() == sin.stride()
    if T:
        # enable_fp_fusion=False: the GPU compiler would otherwise fuse a product into the sum
        # (one rounding, where torch's ops and the interpreter round twice)
        _rotary_kernel[(T, Hq + k.shape[1])](q, k, cos, sin, q.stride(0), q.stride(1),
                                             k.stride(0), k.stride(1), cos.stride(0), HQ=Hq,
                                             HALF=R // 2, BLOCK=triton.next_power_of_2(R // 2),
                                             enable_fp_fusion=False)
