"""The Triton fused-MoE kernel (vLLM's `fused_moe` design): the experts of a FusedMoE layer as
two grouped GEMM launches on the GPU instead of a loop over active experts.

`align_block_size` sorts the T x k (token, expert) pairs by expert and pads each expert's run
to a multiple of BLOCK_M with an out-of-range pair id, so that every BLOCK_M rows of the sorted
order belong to one expert (`block_expert`), in buffers sized by T, k and E alone (no host
sync: decode steps run as CUDA graphs). One program then computes one BLOCK_M x BLOCK_N
tile of C = A[rows] @ W[expert]^T: launch one gathers the pairs' token rows of x and
multiplies by w13 (E, 2I, H); SiLU-and-mul runs between; launch two multiplies the pairs'
intermediate rows by w2 (E, H, I) and scales each row by its routing weight; the k rows of a
token are summed last. Padding rows are masked in every load and store.

The same function runs on CUDA and, with TRITON_INTERPRET=1, on CPU tensors: the tests check
it against the grouped PyTorch path there (equal to float32 rounding: the k experts of a
token are summed in another order). float32 products are IEEE (no TF32), like the attention
kernel's.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenmill.layers.activation import SiluAndMul

BLOCK_M, BLOCK_N, BLOCK_K = 16, 32, 32


@triton.jit
def _moe_gemm_kernel(
    a_ptr, w_ptr, c_ptr, pair_weights_ptr, sorted_pairs_ptr, block_expert_ptr,
    num_pairs, N, K, stride_am, stride_we, stride_wn, stride_cm,
    A_ROWS_PER_PAIR_DIV: tl.constexpr, MUL_WEIGHTS: tl.constexpr, PRECISION: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    if tl.load(sorted_pairs_ptr + pid_m * BM) >= num_pairs:  # a block of padding alone
        return
    pairs = tl.load(sorted_pairs_ptr + pid_m * BM + tl.arange(0, BM))  # (BM,)
    ok = pairs < num_pairs  # padding rows hold num_pairs
    expert = tl.load(block_expert_ptr + pid_m)
    a_rows = pairs // A_ROWS_PER_PAIR_DIV  # token rows of x (launch 1) or pair rows (2)
    n = pid_n * BN + tl.arange(0, BN)
    n_ok = n < N
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        kk = k0 + tl.arange(0, BK)
        k_ok = kk < K
        a = tl.load(a_ptr + a_rows[:, None] * stride_am + kk[None, :],
                    mask=ok[:, None] & k_ok[None, :], other=0.0)  # (BM, BK)
        w = tl.load(w_ptr + expert * stride_we + n[:, None] * stride_wn + kk[None, :],
                    mask=n_ok[:, None] & k_ok[None, :], other=0.0)  # (BN, BK)
        acc += tl.dot(a, tl.trans(w), input_precision=PRECISION)
    if MUL_WEIGHTS:
        acc *= tl.load(pair_weights_ptr + pairs, mask=ok, other=0.0)[:, None]
    tl.store(c_ptr + pairs[:, None] * stride_cm + n[None, :], acc.to(c_ptr.dtype.element_ty),
             mask=ok[:, None] & n_ok[None, :])


def align_block_size(ids: torch.Tensor, num_experts: int, block_m: int = BLOCK_M
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """ids (T, k) → sorted pair ids padded per expert to multiples of block_m (padding: T k),
    and each block's expert (num_blocks,).

    Sizes depend on T, k and E alone, never on the routing (as vLLM's moe_align_block_size):
    no host sync, so a CUDA graph captures it. Each expert's run takes a whole number of
    blocks, which bounds the total by T k + E (block_m - 1); blocks past the experts' runs are
    all padding (their expert clamped to E - 1, never read: the kernel returns at once), and a
    block starts with a real pair whenever it holds one."""
    flat = ids.reshape(-1)
    num_pairs = flat.numel()
    order = torch.argsort(flat, stable=True)  # pair ids by expert
    counts = torch.zeros(num_experts, dtype=torch.int64, device=ids.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))  # (E,); bincount would sync
    padded = (counts + block_m - 1) // block_m * block_m
    ends = torch.cumsum(padded, 0)  # each expert's run ends here (exclusive)
    firsts = torch.cumsum(counts, 0) - counts  # each expert's first sorted pair
    num_blocks = -(-(num_pairs + num_experts * (block_m - 1)) // block_m)
    sorted_pairs = torch.full((num_blocks * block_m,), num_pairs, dtype=torch.int64,
                              device=ids.device)
    expert = flat[order]
    rank = torch.arange(num_pairs, device=ids.device) - firsts[expert]
    sorted_pairs[ends[expert] - padded[expert] + rank] = order
    block_starts = torch.arange(num_blocks, device=ids.device) * block_m
    block_expert = torch.searchsorted(ends, block_starts, right=True).clamp_(max=num_experts - 1)
    return sorted_pairs, block_expert


def _gemm(a: torch.Tensor, w: torch.Tensor, out: torch.Tensor, sorted_pairs: torch.Tensor,
          block_expert: torch.Tensor, num_pairs: int, rows_div: int,
          pair_weights: torch.Tensor | None) -> None:
    """out[p] = a[p // rows_div] @ w[expert of p]^T (x its weight) for every sorted pair p."""
    N, K = w.shape[1], w.shape[2]
    grid = (block_expert.numel(), triton.cdiv(N, BLOCK_N))
    _moe_gemm_kernel[grid](
        a, w, out, pair_weights if pair_weights is not None else out, sorted_pairs,
        block_expert, num_pairs, N, K, a.stride(0), w.stride(0), w.stride(1), out.stride(0),
        A_ROWS_PER_PAIR_DIV=rows_div, MUL_WEIGHTS=pair_weights is not None,
        PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
        BM=BLOCK_M, BN=BLOCK_N, BK=BLOCK_K)


def fused_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                  weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """x (T, H), w13 (E, 2I, H), w2 (E, H, I), routing weights / ids (T, k) → (T, H)."""
    T, k = ids.shape
    x, w13, w2 = x.contiguous(), w13.contiguous(), w2.contiguous()
    sorted_pairs, block_expert = align_block_size(ids, w13.shape[0])
    gate_up = x.new_empty(T * k, w13.shape[1])  # (T k, 2I), row = pair
    _gemm(x, w13, gate_up, sorted_pairs, block_expert, T * k, k, None)
    h = SiluAndMul()(gate_up).contiguous()  # (T k, I)
    down = x.new_empty(T * k, w2.shape[1])  # (T k, H)
    _gemm(h, w2, down, sorted_pairs, block_expert, T * k, 1,
          weights.reshape(-1).to(torch.float32).contiguous())
    return down.view(T, k, -1).sum(1)
