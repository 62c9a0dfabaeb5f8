"""The decoder layers of a CPU step in one C++ call.

Called op by op from Python, each of a layer's ten module calls pays its interpreter, wrapper
and check cost: about 150 µs a layer, 4.5 ms a step over SmolLM2's 30 layers, while the
second core waits (a single-stream decode step reads its weights in about 22 ms in float32;
a 64-sequence decode step took 6-19% less time in one call, benchmarks/RESULTS.md). The C++
call (csrc/decode_layers_cpu.cpp) runs the same ops in the same order with the same kernels
and releases the GIL while it runs; each linear layer's weight comes from its quantization
method object (`cpu_kernel`: dense float32, half precision, Q8_0, 4-bit blocks, K-quants), so
every weight format the methods know takes this path and none is written twice. Results are
bitwise equal to the modules' forward (tests/models/test_cpu_decode.py).

What it runs is what the modules state they compute (layers/op_spec.py), never what their
types suggest: the plan is built from each layer's `OpSpec` tree and the model's RoPE table,
and the call runs only when the C++ side implements every op and variant they require (its
`OPS`: a pre-norm block of RMSNorms, RoPE over whole heads (after an RMSNorm of each head's q
and k, Qwen3's, or of all heads at once and a clamp, OLMoE's), paged attention with or without
one window, a key rotation and a float32 / bfloat16 / int8 / fp8 cache, linear layers with
biases, LoRA adapter slots (a step's rows' deltas: csrc/lora_cpu.h, as lora/layers.py adds
them) and the shared-memory all-reduce, a gated MLP with SiLU, GELU or GELU-tanh, or a mixture
of experts: a router, then the experts' C++ loop of layers/fused_moe.py, and a shared expert
where the block has one), for float32 activations on CPU, with all layers alike in what the
call takes once (heads, eps, scale, window, backend), a step whose every query goes to the
CPU paged-attention kernel (the attention backend says so through `fused_decode_queries`:
decodes and prefill chunks alike), and at most as many rows as every linear layer's method
multiplies through the kernel it states (`CPULinearKernel.max_rows`: a float32 weight
without batch invariance takes oneDNN above 4 rows, so those steps run the modules).
Anything else (another op, a variant, a subclass that redefines a forward) runs the modules,
whose layers call the same kernels through the same method objects.

The runner attaches it (`attach_fused_layers`, worker/model_runner.py and the draft model's
runner): a model declares its layers and never builds or picks a fast path itself.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from tokenmill.attention import AttentionMetadata
from tokenmill.distributed.shm_all_reduce import ShmAllReduce
from tokenmill.layers import cpu_ops
from tokenmill.layers.attention import Attention
from tokenmill.layers.op_spec import OpSpec, spec_of
from tokenmill.utils.cpp_extension import load_cpu_extension
from tokenmill.utils.profiling import scope

logger = logging.getLogger(__name__)

# A linear layer as decode_layers takes it: (kind, group, tensors, int8 activations, input
# scale or None, batch-invariant, bias or None).
LinearArgs = tuple[int, int, list[torch.Tensor], bool, torch.Tensor | None, bool,
                   torch.Tensor | None]


@functools.cache
def _module() -> Any | None:
    return load_cpu_extension("decode_layers_cpu")


def _decode_layers_op() -> Any | None:
    module = _module()
    return None if module is None else module.decode_layers


def implemented_ops() -> frozenset[str]:
    """The ops and variants decode_layers computes (empty without the kernels)."""
    module = _module()
    return frozenset() if module is None else frozenset(module.OPS)


@dataclass(frozen=True)
class _Plan:
    """What decode_layers reads, gathered once (after the runner bound the KV caches)."""

    norms: list[torch.Tensor]  # in_norm, post_norm per layer
    qk_norms: list[torch.Tensor]  # q_norm, k_norm per layer (Qwen3, OLMoE), or none
    qk_norm_all_heads: bool  # the norms span all heads at once (OLMoE), not each head
    clip_qkv: float  # q, k, v clamped to +-clip_qkv after the norms (OLMoE); 0: none
    # per layer: qkv, o, then gate_up, down (an MoE layer: its router, then its shared
    # expert's gate, gate_up, down where it has one)
    linears: list[LinearArgs]
    # beside each linear layer: its LoRA slots (a, b, ranks, scales, present) or None
    loras: list[tuple[torch.Tensor, list[torch.Tensor], torch.Tensor, torch.Tensor,
                      torch.Tensor] | None]
    acts: list[int]  # each layer's (or its shared expert's) gated activation, cpu_ops' code
    # per layer: (experts, top_k, renormalize, shared expert) or (None, 0, False, False)
    moe: list[tuple[Any, int, bool, bool]]
    attns: list[Attention]
    heads: tuple[int, int, int]  # Hq, Hkv, D
    eps: float
    scale: float
    comm: ShmAllReduce | None  # tensor parallelism: the all-reduce the call makes itself
    window: int | None  # every layer's sliding window (Mistral), or None
    rope_key: str  # the one RoPE table all layers read
    lora_step: Any  # the step's rows by adapter (lora/layers.py LoRAStep), or None
    max_rows: int | None  # the most rows every linear layer's stated kernel takes; None: any


def attach_fused_layers(model: nn.Module, device: torch.device) -> None:
    """Give a model's decoder stack (LlamaModel and the stacks built on it) the fused call on
    its layers, on CPU; the call itself declines at its first step what it does not compute."""
    stack = getattr(model, "model", None)
    if device.type != "cpu" or not hasattr(stack, "fused_layers"):
        return
    here = stack.layer_range
    stack.fused_layers = FusedLayers(stack.layers[here.start:here.stop], stack.rotary_embs)


class FusedLayers:
    """The decoder layers of a model, run for a CPU step in one call (see module doc)."""

    def __init__(self, layers: nn.ModuleList, rotary_embs: nn.ModuleDict) -> None:
        self.layers = layers
        self.rotary_embs = rotary_embs
        self.enabled = True  # off: the modules (benchmarks/decode_paths.py compares them)

    def applies(self, hidden: torch.Tensor, meta: AttentionMetadata) -> bool:
        rows = hidden.shape[0]
        if not (self.enabled and rows > 0 and cpu_ops.fused(hidden) and self._plan is not None
                and (self._plan.max_rows is None or rows <= self._plan.max_rows)):
            return False
        return self._queries(meta, rows) is not None

    def _queries(self, meta: AttentionMetadata, num_tokens: int) -> Any | None:
        """The attention kernel's queries for this step, when its backend lets the fused call
        run the kernel (every query of a plain decode step goes to it), else None."""
        return self._plan.attns[0].backend.fused_decode_queries(meta, num_tokens)

    def run(self, hidden: torch.Tensor, tables: dict[str, tuple[torch.Tensor, torch.Tensor]],
            meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden (T, H) embeddings → (hidden, residual) after the last layer, as the modules'
        loop returns them. tables: RoPE key → cos / sin (T, 1, D), as RotaryEmbedding gives
        them. Only after `applies` said True."""
        plan = self._plan
        cos, sin = tables[plan.rope_key]
        p = self._queries(meta, hidden.shape[0])
        comm = plan.comm
        shm = (None, 0, 1, 0, 0.0) if comm is None else comm.kernel_args()
        with scope("tokenmill::decode_layers"):
            hidden, residual, seq = _decode_layers_op()(
                hidden, plan.norms, plan.linears, [a.kv_cache for a in plan.attns],
                [a.kv_scales for a in plan.attns], plan.attns[0].rotation_weight, cos, sin,
                meta.slot_mapping, p.block_tables, p.seq_rows, p.first_keys(plan.window),
                p.ctx_lens,
                *plan.heads, plan.eps, plan.scale, *shm[:4],
                0 if comm is None else comm.seq, shm[4], plan.acts, p.split_keys, plan.moe,
                *_lora_args_of_step(plan), plan.qk_norms, plan.qk_norm_all_heads,
                plan.clip_qkv)
        if comm is not None:
            comm.seq = seq
        return hidden, residual

    @functools.cached_property
    def _plan(self) -> _Plan | None:
        """Taken at the first step (weights processed, huge pages moved, caches bound); None,
        cached too, when the call does not compute what the layers state."""
        if _decode_layers_op() is None or not self.layers or len(self.rotary_embs) != 1:
            return None
        specs = [spec_of(layer) for layer in self.layers]
        rope = spec_of(next(iter(self.rotary_embs.values())))
        if any(s is None for s in specs) or rope is None:
            return None
        missing = set().union(*(s.requires() for s in specs), rope.requires())
        missing -= implemented_ops()
        if missing:
            logger.debug("fused decode call off: the C++ side does not compute %s",
                         ", ".join(sorted(missing)))
            return None
        return _plan_of(specs)


def _linear_args(spec: OpSpec) -> LinearArgs:
    return (*spec.params["kernel"].as_args(), spec.params["bias"])


def _lora_args(spec: OpSpec) -> tuple | None:
    lora = spec.params.get("lora")
    return None if lora is None else (lora.a, lora.b, lora.ranks, lora.scales, lora.present)


def _lora_args_of_step(plan: _Plan) -> tuple[list, torch.Tensor | None]:
    """The layers' LoRA slots and each row's slot this step; nothing when no row has an
    adapter (the slots then cost the call no argument conversion)."""
    step = plan.lora_step
    if step is None or not step.groups:
        return [], None
    return plan.loras, step.row_slot


def _plan_of(specs: list[OpSpec]) -> _Plan | None:
    """The call's arguments from the layers' specs; None where the layers differ in what the
    call takes once for all of them."""
    attn = [s.parts["self_attn"] for s in specs]
    norms = [(s.parts["input_layernorm"], s.parts["post_attention_layernorm"]) for s in specs]
    first = attn[0].params
    eps = norms[0][0].params["eps"]
    qk = [(a.parts["q_norm"], a.parts["k_norm"]) for a in attn if "q_norm" in a.parts]
    if qk and (len(qk) != len(attn) or {n.params["eps"] for pair in qk for n in pair} != {eps}):
        return None  # q/k norms in some layers only, or with another eps
    if len({(a.variants & {"qk_norm_all_heads"}, a.params.get("clip_qkv")) for a in attn}) > 1:
        return None  # layers norming or clipping differently
    backend, rotation = first["attn"].backend, first["attn"].key_rotation
    comms = {id(a.parts["o_proj"].params["comm"]) for a in attn}
    for a, (n_in, n_post), s in zip(attn, norms, specs, strict=True):
        p = a.params
        if (p["heads"] != first["heads"] or p["scale"] != first["scale"]
                or p["window"] != first["window"] or {n_in.params["eps"],
                                                       n_post.params["eps"]} != {eps}
                or p["attn"].backend is not backend or p["attn"].key_rotation is not rotation
                or s.params["rope_key"] != specs[0].params["rope_key"] or len(comms) != 1):
            return None
    acts, linear_specs, moe = [], [], []
    for s in specs:
        mlp = s.parts["mlp"]
        linear_specs += [s.parts["self_attn"].parts[n] for n in ("qkv_proj", "o_proj")]
        if mlp.op == "moe":
            linear_specs.append(mlp.parts["gate"])
            shared = "shared_expert" in mlp.variants
            moe.append((*_experts_args(mlp.parts["experts"]), shared))
            if not shared:
                acts.append(0)
                continue
            linear_specs.append(mlp.parts["shared_expert_gate"])
            mlp = mlp.parts["shared_expert"]  # a gated MLP
        else:
            moe.append((None, 0, False, False))
        (act,) = mlp.parts["act_fn"].variants
        acts.append(cpu_ops.gated_act_code(act))
        linear_specs += [mlp.parts[n] for n in ("gate_up_proj", "down_proj")]
    loras = [_lora_args(s) for s in linear_specs]
    steps = {id(lin.step): lin.step for s in linear_specs
             if (lin := s.params.get("lora")) is not None}
    if len(steps) > 1:  # one manager's step for every layer, or no call
        return None
    return _Plan(norms=[n.params["weight"] for pair in norms for n in pair],
                 qk_norms=[n.params["weight"] for pair in qk for n in pair],
                 qk_norm_all_heads="qk_norm_all_heads" in attn[0].variants,
                 clip_qkv=float(attn[0].params.get("clip_qkv") or 0.0),
                 linears=[_linear_args(s) for s in linear_specs], loras=loras,
                 acts=acts, moe=moe, attns=[a.params["attn"] for a in attn],
                 heads=first["heads"],
                 eps=eps, scale=first["scale"],
                 comm=attn[0].parts["o_proj"].params["comm"] if _split(attn[0]) else None,
                 window=first["window"], rope_key=specs[0].params["rope_key"],
                 lora_step=next(iter(steps.values()), None),
                 max_rows=min((k.max_rows for spec in linear_specs
                               if (k := spec.params["kernel"]).max_rows is not None),
                              default=None))


def _experts_args(spec: OpSpec) -> tuple[Any, int, bool]:
    """An MoE block's experts as the call takes them: bound once in this module's own class
    (the same C++ as cpu_ops.moe_experts), top_k, renormalize."""
    (act,) = spec.parts["act_fn"].variants
    experts = cpu_ops.moe_experts(*spec.params["layer"].expert_kernels(), act, build=_module())
    return experts, spec.params["top_k"], "renormalize" in spec.variants


def _split(attn: OpSpec) -> bool:
    """Whether the layers' row-parallel outputs are summed over ranks (by the call itself)."""
    return "tp_all_reduce" in attn.parts["o_proj"].variants
