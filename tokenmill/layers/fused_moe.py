"""FusedMoE: a layer of experts (gated SiLU MLPs) behind top-k routing, computed grouped.

Weights, per expert e: w13[e] (2 I, H), the gate (w1) rows then the up (w3) rows, as a merged
gate_up projection; w2[e] (H, I). Under tensor parallelism each expert's intermediate features
are split as an MLP's are (w13 by rows, w2 by columns) and the experts' sum is all-reduced
once. Checkpoint tensors arrive one expert and one matrix at a time (`weight_loader` with
shard (e, "w1" | "w3" | "w2")); `expected_shards` lists them all, so a missing expert is an
error at load.

Routing (`select_experts`): softmax over the router logits in float32, top-k, renormalized to
sum 1 where the model does (Mixtral does; `renormalize`).

Grouped computation (`grouped_experts`): the T x k (token, expert) pairs are sorted by expert
once, so each active expert's tokens are one contiguous slice: one gate_up GEMM, SiLU-and-mul,
one down GEMM, scaled by the routing weights and added into the output rows with one
index_add. The Python loop runs over the active experts (at most E), never over tokens, and the
experts are added in ascending order, as Hugging Face's loop adds them. Where every product
goes through the C++ linear op (CPU, float32: quantized experts, or batch-invariant float
ones), the same loop runs in one C++ call (cpu_ops.moe_experts, csrc/moe_cpu.h: the same ops,
bitwise the same result, without ~100 interpreted op calls a layer in a decode step).
`masked_experts` is Hugging Face's loop (a one-hot mask and a `where` per expert), kept for
benchmarks/moe.py.

On CUDA the experts run as the Triton fused-MoE kernel's two grouped GEMM launches instead
(layers/fused_moe_triton.py). Quantized experts (int8 / int4, quantization/moe.py): the same
grouping, each active expert's two products through the C++ linear op on its blocks instead
of F.linear on float weights. Batch-invariant (the model's quantization config says so), float
experts take the C++ op too: a token's products then do not depend on how many other tokens
its experts serve in the step, and its experts' outputs are added in expert order.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.distributed import ParallelState
from tokenmill.layers import cpu_ops
from tokenmill.layers.activation import SiluAndMul
from tokenmill.layers.op_spec import OpSpec, spec_of
from tokenmill.quantization.base import CPULinearKernel, QuantizationConfig
from tokenmill.quantization.moe import moe_quant_method


def select_experts(router_logits: torch.Tensor, top_k: int, renormalize: bool
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits (T, E) → routing weights (T, k) float32 and expert ids (T, k)."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights /= weights.sum(dim=-1, keepdim=True)
    return weights, ids


# expert e's product: (e, x (n, K)) → (n, N)
ExpertProduct = Callable[[int, torch.Tensor], torch.Tensor]


def grouped_experts(x: torch.Tensor, up: ExpertProduct, down: ExpertProduct,
                    weights: torch.Tensor, ids: torch.Tensor, act: nn.Module,
                    num_experts: int) -> torch.Tensor:
    """x (T, H), up(e, ·): (·, H) → (·, 2I), down(e, ·): (·, I) → (·, H), weights / ids
    (T, k) → (T, H)."""
    k = ids.shape[1]
    flat = ids.reshape(-1)  # (T k,) token-major
    order = torch.argsort(flat, stable=True)  # the pairs, by expert
    counts = torch.bincount(flat, minlength=num_experts).tolist()  # the one host sync
    tokens = order // k  # (T k,) each sorted pair's token
    pair_weights = weights.reshape(-1)[order]
    xs = x[tokens]  # (T k, H), gathered once
    out = torch.zeros_like(x)
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        rows = slice(start, start + n)
        h = act(up(e, xs[rows]))  # (n, I)
        y = down(e, h) * pair_weights[rows, None]  # (n, H), float32 weights
        out.index_add_(0, tokens[rows], y.to(out.dtype))
        start += n
    return out


def masked_experts(x: torch.Tensor, up: ExpertProduct, down: ExpertProduct,
                   weights: torch.Tensor, ids: torch.Tensor, act: nn.Module,
                   num_experts: int) -> torch.Tensor:
    """The per-expert loop of Hugging Face's Mixtral (a mask and a `where` per expert): the
    baseline benchmarks/moe.py measures the grouped path against."""
    out = torch.zeros_like(x)
    mask = F.one_hot(ids, num_classes=num_experts).permute(2, 1, 0)  # (E, k, T)
    for e in range(num_experts):
        pos, tok = torch.where(mask[e])
        if tok.numel() == 0:
            continue
        y = down(e, act(up(e, x[tok]))) * weights[tok, pos, None]
        out.index_add_(0, tok, y.to(out.dtype))
    return out


class FusedMoE(nn.Module):
    """E experts of intermediate size I over hidden size H, top_k of them per token."""

    computes = ("forward", "up", "down", "_product")

    grouped = True  # False: masked_experts (benchmarks/moe.py compares the two)
    # the Triton kernel (layers/fused_moe_triton.py): None = on CUDA when triton is there;
    # True forces it (tests run it in Triton's interpreter on CPU)
    use_triton: bool | None = None

    def __init__(self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int,
                 renormalize: bool, tp: ParallelState = ParallelState(),
                 quant_config: QuantizationConfig | None = None, prefix: str = "") -> None:
        super().__init__()
        if intermediate_size % tp.tp_size:
            raise ValueError(f"tensor_parallel_size={tp.tp_size} cannot split the experts' "
                             f"{intermediate_size} intermediate features evenly")
        self.num_experts, self.top_k, self.renormalize, self.tp = (num_experts, top_k,
                                                                   renormalize, tp)
        self.shard = intermediate_size // tp.tp_size  # this rank's intermediate features
        dtype = torch.get_default_dtype()
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * self.shard, hidden_size,
                                            dtype=dtype), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden_size, self.shard, dtype=dtype),
                               requires_grad=False)
        for param, names in ((self.w13, ("w1", "w3")), (self.w2, ("w2",))):
            param.weight_loader = self.weight_loader
            param.expected_shards = [(e, n) for e in range(num_experts) for n in names]
        self.act = SiluAndMul()
        # quantized experts: the loader calls its process_weights_after_loading; a format
        # stored in blocks (GGUF) replaces w13 / w2 by its own parameters
        self.quant_method = moe_quant_method(quant_config, prefix)
        if hasattr(self.quant_method, "create_weights"):
            self.quant_method.create_weights(self)
        self.batch_invariant = quant_config is None or quant_config.batch_invariant
        self._kernels: dict[tuple[str, int], tuple[int, CPULinearKernel]] = {}
        self._experts_op: tuple[int, object] | None = None  # (where, cpu_ops.moe_experts)

    @torch.no_grad()
    def weight_loader(self, param: nn.Parameter, tensor: torch.Tensor,
                      shard: tuple[int, str]) -> None:
        """One expert's w1 / w3 (I, H) or w2 (H, I) from the checkpoint, this rank's part."""
        e, name = shard
        lo = self.tp.tp_rank * self.shard
        if name == "w2":
            param.data[e].copy_(tensor[:, lo:lo + self.shard])
        else:
            half = 0 if name == "w1" else self.shard
            param.data[e, half:half + self.shard].copy_(tensor[lo:lo + self.shard])

    def _triton(self, x: torch.Tensor) -> bool:
        if self.quant_method is not None:  # (quantized experts: the CPU kernels)
            return False
        if self.use_triton is not None:
            return self.use_triton
        from tokenmill.attention.triton_paged import triton_available

        return x.is_cuda and triton_available()

    def up(self, e: int, x: torch.Tensor) -> torch.Tensor:
        """Expert e's gate_up product: (n, H) → (n, 2I)."""
        return self._product("w13", e, x)

    def down(self, e: int, h: torch.Tensor) -> torch.Tensor:
        """Expert e's down product: (n, I) → (n, H)."""
        return self._product("w2", e, h)

    def _product(self, name: str, e: int, x: torch.Tensor) -> torch.Tensor:
        if self._cpu_kernels(x):
            return cpu_ops.linear(x, self._kernel(name, e))
        return F.linear(x, getattr(self, name)[e])

    def _cpu_kernels(self, x: torch.Tensor) -> bool:
        """Whether the experts' products take the C++ linear op: quantized ones always,
        float ones when batch-invariant on CPU."""
        return self.quant_method is not None or (self.batch_invariant and cpu_ops.fused(x))

    def _kernel(self, name: str, e: int) -> CPULinearKernel:
        """The kernel of expert e's `name` (w13 | w2) matrix, built once (a decode step asks
        for 2 top_k of them per layer) and again if the parameters moved (huge pages, a
        device)."""
        where = next(self.parameters()).data_ptr()
        cached = self._kernels.get((name, e))
        if cached is None or cached[0] != where:
            kernel = (self.quant_method.kernel(self, name, e) if self.quant_method is not None
                      else CPULinearKernel(CPULinearKernel.DENSE, 0, (getattr(self, name)[e],)))
            cached = self._kernels[name, e] = (where, kernel)
        return cached[1]

    def _experts(self) -> object:
        """The experts bound once for the C++ grouped loop (cpu_ops.moe_experts), again if
        the parameters moved."""
        where = next(self.parameters()).data_ptr()
        if self._experts_op is None or self._experts_op[0] != where:
            act = next(iter(self.act.op_spec().variants))
            up, down = self.expert_kernels()
            self._experts_op = (where, cpu_ops.moe_experts(up, down, act))
        return self._experts_op[1]

    def expert_kernels(self) -> tuple[list[CPULinearKernel], list[CPULinearKernel]]:
        """Each expert's gate_up and down kernels (the C++ products' weights)."""
        return ([self._kernel("w13", e) for e in range(self.num_experts)],
                [self._kernel("w2", e) for e in range(self.num_experts)])

    def op_spec(self) -> OpSpec | None:
        """Routing (select_experts: `renormalize` where the model does) and the grouped
        experts through their C++ kernels (csrc/moe_cpu.h), on CPU; None where the experts
        take other products (float experts not batch-invariant, CUDA) or are split over
        ranks (the call makes no all-reduce for them)."""
        probe = next(self.parameters())
        cpu = probe.is_cpu and cpu_ops.ops_available() and (
            self.quant_method is not None or (self.batch_invariant
                                              and probe.dtype is torch.float32))
        act = spec_of(self.act)
        if not (self.grouped and cpu and self.tp.tp_size == 1) or act is None:
            return None
        return OpSpec("moe_experts", frozenset({"renormalize"} if self.renormalize else ()),
                      params={"layer": self, "top_k": self.top_k}, parts={"act_fn": act})

    def forward(self, x: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        """x (T, H), router_logits (T, E) → (T, H), summed over tensor-parallel ranks."""
        weights, ids = select_experts(router_logits, self.top_k, self.renormalize)
        if self._triton(x):
            from tokenmill.layers.fused_moe_triton import fused_experts

            return self.tp.all_reduce(fused_experts(x, self.w13, self.w2, weights, ids))
        if self.grouped and cpu_ops.fused(x) and self._cpu_kernels(x):
            return self.tp.all_reduce(self._experts().forward(x, weights, ids))
        run = grouped_experts if self.grouped else masked_experts
        return self.tp.all_reduce(run(x, self.up, self.down, weights, ids, self.act,
                                      self.num_experts))
