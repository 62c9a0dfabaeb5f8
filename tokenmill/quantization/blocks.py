"""The two block layouts the CPU kernels read, and the PyTorch code that makes and reads them.

- Q8_0: int8 q (N, K) with one float16 scale d per 32 weights (N, K/32): w = d q. llama.cpp's
  Q8_0 numbers, in struct-of-arrays form.
- Q4: 4-bit q packed two per byte (N, K/2) with a float16 scale d and offset m per group of G
  weights (N, K/G): w = d q + m, q in 0..15. Within each 32 weights (16 bytes), byte j holds
  weight j in its low nibble and weight j + 16 in its high one, llama.cpp's Q4_0 / Q4_1 block
  order. GGUF Q4_1 is this with G = 32; Q4_0 is d (q - 8), so m = -8 d (exact in float16);
  AWQ / GPTQ's d (q - z) gives m = -z d, rounded to float16 (a relative error of at most 2^-11
  of z d, under 1% of one quantization step).

`dequantize` is the reference every kernel is tested against (tests/quantization/).
"""

from __future__ import annotations

import torch

from tokenmill.quantization.base import CPULinearKernel

BLOCK = 32


def pack_q4(values: torch.Tensor) -> torch.Tensor:
    """(N, K) integers in 0..15 → (N, K/2) uint8 in llama.cpp's nibble order."""
    N, K = values.shape
    v = values.to(torch.uint8).view(N, K // BLOCK, 2, BLOCK // 2)  # (N, blocks, lo|hi, 16)
    return (v[:, :, 0] | (v[:, :, 1] << 4)).reshape(N, K // 2).contiguous()


def unpack_q4(packed: torch.Tensor) -> torch.Tensor:
    """(N, K/2) uint8 → (N, K) uint8 values in 0..15 (inverse of pack_q4)."""
    N, half = packed.shape
    b = packed.view(N, half // (BLOCK // 2), 1, BLOCK // 2)
    return torch.cat([b & 0x0F, b >> 4], dim=2).reshape(N, 2 * half)


def quantize_q8_0(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(N, K) float → (q (N, K) int8, d (N, K/32) float16): round to nearest, d = amax / 127
    per block (llama.cpp's quantize_row_q8_0)."""
    N, K = w.shape
    if K % BLOCK:
        raise ValueError(f"Q8_0 needs the input size divisible by {BLOCK}, got {K}")
    blocks = w.float().view(N, K // BLOCK, BLOCK)
    d = (blocks.abs().amax(-1) / 127).half()  # (N, K/32)
    inv = torch.where(d == 0, 0.0, 1.0 / d.float())
    q = torch.round(blocks * inv.unsqueeze(-1)).clamp_(-127, 127).to(torch.int8)
    return q.view(N, K).contiguous(), d.contiguous()


def quantize_q4(w: torch.Tensor, group: int,
                clip: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
    """(N, K) float → Q4 (q (N, K/2) uint8, d, m (N, K/G) float16): asymmetric round to
    nearest over [min, max] of each group (clip (N, K/G) in (0, 1] shrinks that range)."""
    N, K = w.shape
    if group % BLOCK or K % group:
        raise ValueError(f"4-bit groups must be a multiple of {BLOCK} dividing the input size "
                         f"{K}, got {group}")
    g = w.float().view(N, K // group, group)
    lo, hi = g.amin(-1), g.amax(-1)
    if clip is not None:
        mid = (lo + hi) / 2
        lo, hi = mid + (lo - mid) * clip, mid + (hi - mid) * clip
    d = ((hi - lo) / 15).half()
    m = lo.half()
    inv = torch.where(d == 0, 0.0, 1.0 / d.float())
    q = torch.round((g - m.float().unsqueeze(-1)) * inv.unsqueeze(-1)).clamp_(0, 15)
    return pack_q4(q.view(N, K)), d.contiguous(), m.contiguous()


def from_zero_points(q: torch.Tensor, z: torch.Tensor, s: torch.Tensor,
                     group: int) -> tuple[torch.Tensor, ...]:
    """The (K, N) form of AWQ / GPTQ checkpoints, w[k, n] = s[k/G, n] (q[k, n] - z[k/G, n]),
    → Q4 (q (N, K/2), d, m (N, K/G)) with d = s and m = -z s (float16, see module doc)."""
    d = s.t().contiguous().half()
    m = (-(z.t().float() * s.t().float())).half().contiguous()
    return pack_q4(q.t()), d, m


def effective_weight(kernel: CPULinearKernel) -> torch.Tensor:
    """The float32 (N, K) weight the kernel multiplies x by: the stored one, times the input
    scale per input channel where there is one (y = (x s) Wq^T = x (Wq s)^T)."""
    w = dequantize(kernel)
    return w if kernel.input_scale is None else w * kernel.input_scale.float()


def dequantize(kernel: CPULinearKernel) -> torch.Tensor:
    """The float32 (N, K) weight a kernel's tensors hold (GGUF raw blocks: as the gguf
    package dequantizes them)."""
    t = kernel.tensors
    if kernel.kind == CPULinearKernel.PARTS:
        parts, rest = [], list(t[1:])
        for kind, group, count in t[0].tolist():
            parts.append(dequantize(CPULinearKernel(kind, group, tuple(rest[:count]))))
            rest = rest[count:]
        return torch.cat(parts, 0)
    from tokenmill.quantization.gguf import GGUF_TYPES  # the registry names each raw kind

    in_place = {g.kind: g.name for g in GGUF_TYPES.values() if g.split is None}
    if kernel.kind in in_place:
        import gguf

        qtype = gguf.GGMLQuantizationType[in_place[kernel.kind]]
        return torch.from_numpy(gguf.quants.dequantize(t[0].numpy(), qtype).copy())
    if kernel.kind in (CPULinearKernel.Q8_0_TILES, CPULinearKernel.Q4_TILES,
                       CPULinearKernel.Q4_K_TILES, CPULinearKernel.Q6_K_TILES):
        from tokenmill.quantization.block_tiles import unpack

        return dequantize(unpack(kernel))
    if kernel.kind == CPULinearKernel.DENSE:
        return t[0].float()
    if kernel.kind == CPULinearKernel.Q8_0:
        return t[0].float() * t[1].float().repeat_interleave(BLOCK, dim=1)
    G = kernel.group
    d, m = t[1].float().repeat_interleave(G, 1), t[2].float().repeat_interleave(G, 1)
    return unpack_q4(t[0]).float() * d + m
