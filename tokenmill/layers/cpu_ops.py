"""Fused float32 CPU ops for the layers (csrc/cpu_ops.cpp), with their PyTorch fallbacks.

`fused(x)` says whether a tensor can take the C++ path (float32 on CPU, kernels built); the
layers call the op when it can and their plain PyTorch code otherwise, which is also what the
ops are tested against (tests/layers/test_cpu_ops.py). The ops cut the small per-layer work
of a decode step (norm + residual add, SiLU-and-multiply, RoPE: one pass each instead of
several tensor ops) and run every linear layer's weight format (`linear`; a small-batch GEMM,
M <= 4, streams the weight at close to the machine's memory bandwidth).
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from tokenmill.utils.cpp_extension import load_cpu_extension
from tokenmill.utils.profiling import scope

# Up to this many rows, a dense linear layer reads its weight through `linear` (bound by
# streaming the weight once); beyond it, the GEMM libraries are faster.
SMALL_M = 4


@functools.cache
def _ops() -> Any | None:
    return load_cpu_extension("cpu_ops")


def ops_available() -> bool:
    return _ops() is not None


def fused(x: torch.Tensor) -> bool:
    """True when x may take the fused C++ ops: float32 on CPU, with the kernels built."""
    # Called several times per layer in a decode step: cheapest checks first.
    return x.dtype is torch.float32 and x.is_cpu and _ops() is not None


def linear(x: torch.Tensor, kernel: Any, bias: torch.Tensor | None = None,
           build: Any = None) -> torch.Tensor:
    """x (M, K) @ W^T + bias → (M, N) for a weight described by `kernel` (a
    quantization.CPULinearKernel: dense float32, Q8_0 or 4-bit blocks; csrc/linear_cpu.h).
    A batch-invariant kernel sums every row in an order that does not depend on M. `build`:
    another installed kernel build's module (tokenmill._C.cpu_ops_<isa>; tests, benchmarks)
    instead of the one this CPU runs."""
    with scope("tokenmill::linear"):  # a GEMM in benchmarks/profile_step.py
        kind, group, tensors, int8_acts, input_scale, invariant = kernel.as_args()
        return (build or _ops()).linear(x, kind, group, tensors, bias, int8_acts, input_scale,
                                        invariant)


def lora_add_(x: torch.Tensor, y: torch.Tensor, a: torch.Tensor, b: list[torch.Tensor],
              ranks: torch.Tensor, scales: torch.Tensor, present: torch.Tensor,
              row_slot: torch.Tensor) -> None:
    """y (T, N) += each row's LoRA delta, every adapter slot of the step in one call
    (csrc/lora_cpu.h; the slots' layout: lora/layers.py LinearLoRA)."""
    with scope("tokenmill::lora"):
        _ops().lora_add_(x, y, a, b, ranks, scales, present, row_slot)


def gguf_activation_block(k: int, build: Any = None) -> int | None:
    """How the GGUF block kinds (Q5_0 .. Q6_K) take float activations with K inputs: rounded
    to int16 per this many values (256 where K allows, else 32; csrc/linear_gguf_rows.h, the
    SIMD builds), or None where they multiply them exactly (the portable build). `build`: as
    for linear."""
    if not (build or _ops()).GGUF_INT16_ACTIVATIONS:
        return None
    return 256 if k % 256 == 0 else 32


def bf16_products_hardware(enable: bool | None = None) -> bool:
    """Whether weight kind BF16_PRODUCTS runs on AVX512-BF16 here (the CPU has it and the
    switch is on); `enable` sets this module's switch (False: the float32 emulation, the same
    bits; csrc/linear_bf16.h). Returns the state before."""
    return bool(_ops().bf16_products_hardware(enable))


def bf16_products_amx(enable: bool | None = None) -> bool:
    """Whether bfloat16 weights multiplied in bfloat16 are packed at load for AMX tiles here
    (kind BF16_TILES: the CPU has AMX-BF16, Linux granted the tile state, the hardware switch
    is on): the tile unit's order of sums, still batch-invariant but not vdpbf16ps's bits
    (csrc/linear_bf16_amx.h). `enable` sets this module's switch (False: the loader keeps
    kind BF16_PRODUCTS, vdpbf16ps). Returns the state before."""
    return bool(_ops().bf16_products_amx(enable))


def block_tiles(enable: bool | None = None) -> bool:
    """The switch of the block tiles: on (the default), the loader packs Q8_0, 4-bit and GGUF
    Q4_K block weights into tiles of 16 rows where the build has their kernels (`packs_kind`;
    the same rounding of x and integers as the stored kinds, batch-invariant, another float32
    order; csrc/linear_block_tiles.h, linear_kquant_tiles.h); off, it keeps the stored kinds.
    `enable` sets it. Returns the state before."""
    return bool(_ops().block_tiles(enable))


def packs_kind(kind: int) -> bool:
    """Whether the loader packs block weights of kind `kind` into tiles of 16 rows here (the
    `block_tiles` switch on): Q8_0 and 4-bit blocks on the AVX-512 VNNI build (Q8_0_TILES,
    Q4_TILES), GGUF Q4_K on the AVX2 and AVX-512 builds (Q4_K_TILES)."""
    return bool(_ops().packs_kind(int(kind)))


def block_tiles_amx() -> bool:
    """Whether those tiles are multiplied on AMX-INT8 here (the CPU has it, Linux granted the
    tile state, TOKENMILL_AMX is not 0); elsewhere by vpdpbusd, with the same bits."""
    return bool(_ops().block_tiles_amx())


def bf16_tiles(w: torch.Tensor) -> torch.Tensor:
    """W (N, K) bfloat16 (N a multiple of 16, K of 32) packed for AMX tiles: (N / 16, K / 2,
    16, 2), row 16 g + j's pair of k p at [g, p, j] (weight kind BF16_TILES;
    csrc/linear_bf16_amx.h)."""
    return _ops().bf16_tiles(w)


def gather_rows(ids: torch.Tensor, kernel: Any) -> torch.Tensor:
    """Rows `ids` (T,) of a quantized weight as float32 (T, K)."""
    return _ops().gather_rows(ids, kernel.kind, kernel.group, list(kernel.tensors))


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual) * weight, x + residual), both (…, H)."""
    out, summed = _ops().add_rms_norm(x, residual, weight, eps)
    return out, summed


def gated_act(x: torch.Tensor, act: str) -> torch.Tensor:
    """[gate | up] (…, 2I) → act(gate) * up (…, I), act one of GATED_ACTS ("silu", "gelu",
    "gelu_tanh"), each row alone (its result does not depend on the other rows)."""
    return _ops().gated_act(x, gated_act_code(act))


def sigmoid(x: torch.Tensor) -> torch.Tensor:
    """torch.sigmoid(x), each element computed alike wherever it lies in x (torch's kernel
    rounds a tensor's last few elements otherwise): for values one per token."""
    if fused(x):
        return _ops().sigmoid(x)
    return torch.sigmoid(x)


def moe_experts(up: list[Any], down: list[Any], act: str, build: Any = None) -> Any:
    """An MoE layer's experts bound once for `forward(x (T, H), weights (T, k), ids (T, k))`
    → (T, H): layers/fused_moe.py grouped_experts in one C++ call, bitwise the same
    (csrc/moe_cpu.h). up / down: each expert's CPULinearKernel; act: a GATED_ACTS name.
    `build`: another extension module binding the same class (the fused decode call's, which
    takes only its own objects) instead of this one."""
    return (build or _ops()).MoEExperts([k.as_args() for k in up], [k.as_args() for k in down],
                                        gated_act_code(act))


def gated_act_code(act: str) -> int:
    """The C++ code of a gated activation's name (csrc/cpu_ops.h kGatedActs)."""
    return list(_ops().GATED_ACTS).index(act)


def store_kv_(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              slot_mapping: torch.Tensor, kv_scales: torch.Tensor | None = None) -> None:
    """k_cache / v_cache (num_blocks, bs, Hkv, R) at slot_mapping (T,) <- k, v (T, Hkv, D),
    quantized when the cache is int8 or fp8 (kv_scales (2, Hkv): fp8's; csrc/kv_formats.h)."""
    _ops().store_kv_(k_cache, v_cache, k, v, slot_mapping, kv_scales)


def rotary_(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """rotate_half RoPE in place: q (T, Hq, D), k (T, Hkv, D), cos / sin (T, 1, D)."""
    _ops().rotary_(q, k, cos, sin)


def argmax(x: torch.Tensor) -> torch.Tensor:
    """torch.argmax(x, dim=-1) of a (S, V) matrix; the C++ pass where it applies (13x faster
    than torch's at (64, 49152) on CPU)."""
    if x.dim() == 2 and x.shape[1] > 0 and fused(x):
        return _ops().argmax_rows(x)
    return x.argmax(dim=-1)


def shm_all_reduce_(x: torch.Tensor, segment: torch.Tensor, rank: int, world_size: int,
                    slot_bytes: int, seq: int, timeout_s: float) -> int:
    """x (contiguous float32) summed in place over the ranks sharing `segment`
    (csrc/shm_all_reduce.h; distributed/shm_all_reduce.py); the last sequence number used."""
    return _ops().shm_all_reduce_(x, segment, rank, world_size, slot_bytes, seq, timeout_s)


def apply_token_bitmask_(logits: torch.Tensor, bitmask: torch.Tensor,
                         rows: torch.Tensor) -> bool:
    """-inf in rows `rows` (R,) of logits (S, V) wherever bitmask (R, W) int32 has a 0 bit;
    False (nothing done) with kernels built before the op existed (reinstall for it)."""
    op = getattr(_ops(), "apply_token_bitmask_", None)
    if op is None:
        return False
    op(logits, bitmask, rows)
    return True
