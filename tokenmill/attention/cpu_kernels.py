"""The C++ paged-attention kernel (csrc/paged_attention_cpu.cpp), built on first use.

`paged_attention_op()` returns the op, or None when the kernels are disabled
(TOKENMILL_CPU_KERNELS=0) or cannot be built (no compiler): callers then use the pure-PyTorch
backend, which is also the oracle the kernel is tested against.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from tokenmill.utils.cpp_extension import load_cpu_extension


def paged_attention_op() -> Callable[..., torch.Tensor] | None:
    """paged_attention(q (N,Hq,D), k_cache, v_cache (nb,bs,Hkv,D), block_tables (B,max_blocks),
    seq_rows (N,), start_lens (N,), ctx_lens (N,), scale) -> [out (N,Hq,D), lse (N,Hq)]: query n
    attends cached tokens [start_lens[n], ctx_lens[n]); None if the kernel is unavailable."""
    module = load_cpu_extension("paged_attention_cpu")
    return None if module is None else module.paged_attention


def bf16_on_tiles(head_size: int) -> bool:
    """Whether the kernel attends a bfloat16 cache with heads of `head_size` on the AMX tile unit,
    rounding q and the softmax's p to bfloat16 (csrc/paged_attention_amx.h): CPUs with AMX-BF16,
    heads of 64 or 128, unless TOKENMILL_AMX=0."""
    module = load_cpu_extension("paged_attention_cpu")
    return module is not None and module.bf16_on_tiles(head_size)


def bf16_rounds_qp(head_size: int, group: int) -> bool:
    """Whether the kernel attends a bfloat16 cache with heads of `head_size` and `group` query
    heads per KV head with q and the softmax's p rounded to bfloat16: on the AMX tile unit
    (bf16_on_tiles) or on AVX512-BF16's vdpbf16ps (csrc/paged_attention_keys_dp.h: heads of
    64, groups of 1-6, unless TOKENMILL_BF16_DOT_ATTENTION=0)."""
    module = load_cpu_extension("paged_attention_cpu")
    return module is not None and module.bf16_rounds_qp(head_size, group)
