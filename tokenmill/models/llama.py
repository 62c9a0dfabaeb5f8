"""Llama family (Llama 2/3, SmolLM2, Mistral without sliding window) and Qwen2 (q/k/v bias).

Reads like transformers' modeling_llama.py, with two serving changes: q/k/v and gate/up are
merged into one GEMM each (`packed_modules_mapping` tells the loader how checkpoint names map
onto them), and the input is one flat batch of T tokens from many sequences, with positions
and AttentionMetadata passed explicitly.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from tokenmill.attention import AttentionMetadata
from tokenmill.attention.kv_formats import op_variant
from tokenmill.config import layer_sliding_window
from tokenmill.distributed import ParallelState
from tokenmill.distributed.pipeline import PPMissingLayer
from tokenmill.layers.activation import gated_activation
from tokenmill.layers.attention import Attention
from tokenmill.layers.layernorm import RMSNorm
from tokenmill.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from tokenmill.layers.op_spec import OpSpec, specs_of
from tokenmill.layers.rotary import RotaryEmbedding, rope_key
from tokenmill.layers.vocab_embedding import ParallelLMHead, VocabParallelEmbedding
from tokenmill.quantization import QuantizationConfig


class LlamaAttention(nn.Module):
    computes = ("forward", "split_heads")

    def __init__(self, config: Any, tp: ParallelState, quant: QuantizationConfig | None,
                 prefix: str, layer_idx: int, qkv_bias: bool, o_bias: bool) -> None:
        super().__init__()
        n_heads, n_kv = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // n_heads
        self.qkv_proj = QKVParallelLinear(config.hidden_size, self.head_dim, n_heads, n_kv,
                                          bias=qkv_bias, tp=tp, quant_config=quant,
                                          prefix=f"{prefix}.qkv_proj")
        self.o_proj = RowParallelLinear(n_heads * self.head_dim, config.hidden_size,
                                        bias=o_bias, tp=tp, quant_config=quant,
                                        prefix=f"{prefix}.o_proj")
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.attn = Attention(self.num_heads, self.num_kv_heads, self.head_dim,
                              scale=self.attention_scale(config),
                              sliding_window=layer_sliding_window(config, layer_idx))

    def attention_scale(self, config: Any) -> float:
        """The scores' scale, fixed in the layer's attention variant."""
        return self.head_dim ** -0.5

    def split_heads(self, qkv: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """(T, (Hq + 2 Hkv) D) → q, k, v (T, Hq | Hkv | Hkv, D): one view and three slices,
        the cheapest split, which a batch-1 decode step pays in every layer."""
        T, Hq, Hkv = qkv.shape[0], self.num_heads, self.num_kv_heads
        qkv = qkv.view(T, Hq + 2 * Hkv, self.head_dim)
        return qkv[:, :Hq], qkv[:, Hq:Hq + Hkv], qkv[:, Hq + Hkv:]

    def forward(self, position_embeddings: tuple[torch.Tensor, torch.Tensor],
                hidden: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        q, k, v = self.split_heads(self.qkv_proj(hidden))
        # RoPE (position_embeddings) applied by the attention layer, fused into its KV store
        # where the backend can
        return self.o_proj(self.attn(q, k, v, meta, position_embeddings))  # (T, hidden)

    def op_spec(self) -> OpSpec | None:
        """qkv projection, RoPE (the model's table), paged attention over the layer's cache
        with its variants, output projection."""
        parts = specs_of(qkv_proj=self.qkv_proj, o_proj=self.o_proj)
        a = self.attn
        if parts is None or a.kv_cache is None:
            return None
        on = {"window": a.sliding_window is not None, "soft_cap": a.soft_cap is not None,
              "key_rotation": a.key_rotation is not None}
        variants = {name for name, used in on.items() if used}
        variants.add(op_variant(a.kv_cache.dtype))
        return OpSpec("attention", frozenset(variants), parts=parts,
                      params={"attn": a, "scale": a.scale, "window": a.sliding_window,
                              "heads": (self.num_heads, self.num_kv_heads, self.head_dim)})


def with_qk_norms(attn: LlamaAttention, variants: set[str], **params: Any) -> OpSpec | None:
    """A Llama attention spec with the layer's q_norm / k_norm as parts and `variants` (the
    q/k-norming attentions of Qwen3 and OLMoE state theirs through it)."""
    spec = LlamaAttention.op_spec(attn)
    norms = specs_of(q_norm=attn.q_norm, k_norm=attn.k_norm)
    if spec is None or norms is None:
        return None
    return dataclasses.replace(spec, variants=spec.variants | variants,
                               parts={**spec.parts, **norms}, params={**spec.params, **params})


class LlamaMLP(nn.Module):
    computes = ("forward",)

    def __init__(self, config: Any, tp: ParallelState, quant: QuantizationConfig | None,
                 prefix: str, layer_idx: int | None = None,
                 intermediate_size: int | None = None) -> None:
        super().__init__()
        bias = getattr(config, "mlp_bias", False)
        inter = intermediate_size or config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [inter, inter],
                                                       bias=bias, tp=tp, quant_config=quant,
                                                       prefix=f"{prefix}.gate_up_proj")
        self.down_proj = RowParallelLinear(inter, config.hidden_size, bias=bias, tp=tp,
                                           quant_config=quant, prefix=f"{prefix}.down_proj")
        self.act_fn = gated_activation(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))

    def op_spec(self) -> OpSpec | None:
        parts = specs_of(gate_up_proj=self.gate_up_proj, act_fn=self.act_fn,
                         down_proj=self.down_proj)
        return None if parts is None else OpSpec("gated_mlp", parts=parts)


class LlamaDecoderLayer(nn.Module):
    computes = ("forward",)

    def __init__(self, config: Any, tp: ParallelState, quant: QuantizationConfig | None,
                 prefix: str, layer_idx: int, attention_cls: type[LlamaAttention],
                 mlp_cls: Callable[..., nn.Module] = LlamaMLP,
                 norm_cls: type[RMSNorm] = RMSNorm, **attn_flags: bool) -> None:
        super().__init__()
        self.self_attn = attention_cls(config, tp, quant, f"{prefix}.self_attn", layer_idx,
                                       **attn_flags)
        # the MLP, or an MoE block (a model's mlp_cls may choose by layer_idx)
        self.mlp = mlp_cls(config, tp, quant, f"{prefix}.mlp", layer_idx)
        self.input_layernorm = norm_cls(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = norm_cls(config.hidden_size, config.rms_norm_eps)
        self.rope_key = rope_key(config, layer_idx)  # which cos / sin table its RoPE reads

    def forward(self, position_embeddings: tuple[torch.Tensor, torch.Tensor],
                hidden: torch.Tensor, residual: torch.Tensor | None, meta: AttentionMetadata
                ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(position_embeddings, hidden, meta)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual

    def op_spec(self) -> OpSpec | None:
        """Pre-norm block: (add +) norm, attention, add + norm, MLP; its RoPE table by key."""
        parts = specs_of(input_layernorm=self.input_layernorm, self_attn=self.self_attn,
                         post_attention_layernorm=self.post_attention_layernorm, mlp=self.mlp)
        return None if parts is None else OpSpec("pre_norm_block", parts=parts,
                                                  params={"rope_key": self.rope_key})


class LlamaModel(nn.Module):
    """The decoder stack; under pipeline parallelism this stage's share of it (`tp`'s
    layer_range; the other stages' layers, and the embedding / final norm where another stage
    runs them, are PPMissingLayer). The model class's `layer_cls`, `norm_cls` and
    `embed_scale` make it Gemma's stack too."""

    def __init__(self, config: Any, tp: ParallelState, quant: QuantizationConfig | None,
                 attention_cls: type[LlamaAttention], mlp_cls: Callable[..., nn.Module],
                 layer_cls: type[LlamaDecoderLayer] = LlamaDecoderLayer,
                 norm_cls: type[RMSNorm] = RMSNorm, embed_scale: float | None = None,
                 **attn_flags: bool) -> None:
        super().__init__()
        self.embed_scale = embed_scale  # embeddings x this (Gemma: sqrt(hidden_size))
        self.pp_last = tp.is_last_stage
        tied = bool(getattr(config, "tie_word_embeddings", False))
        # the last stage's tied LM head multiplies with the embedding's table
        self.embed_tokens = (VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp,
                                                    quant, prefix="model.embed_tokens")
                             if tp.is_first_stage or (tied and tp.is_last_stage)
                             else PPMissingLayer())
        here = tp.layer_range(config.num_hidden_layers)
        self.layers = nn.ModuleList(
            layer_cls(config, tp, quant, f"model.layers.{i}", i, attention_cls, mlp_cls,
                      norm_cls, **attn_flags) if i in here else PPMissingLayer()
            for i in range(config.num_hidden_layers))
        self.layer_range = here
        self.norm = (norm_cls(config.hidden_size, config.rms_norm_eps) if tp.is_last_stage
                     else PPMissingLayer())
        head_dim = getattr(config, "head_dim", None) or \
            config.hidden_size // config.num_attention_heads
        # One cos/sin table per RoPE variant (one for most models; Gemma 3's local and global
        # layers have two), gathered once per step for all layers.
        self.rotary_embs = nn.ModuleDict({
            key: RotaryEmbedding(head_dim, config.max_position_embeddings, config, key)
            for key in sorted({rope_key(config, i) for i in here})})
        # The same layers for a CPU step in one C++ call, where it computes everything they
        # state: set by the runner (models/cpu_decode.py attach_fused_layers); None runs the
        # modules
        self.fused_layers: Any = None

    def local_layers(self) -> Iterator[nn.Module]:
        """This stage's decoder layers, in order."""
        return itertools.islice(self.layers, self.layer_range.start, self.layer_range.stop)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                meta: AttentionMetadata, hidden_in: torch.Tensor | None = None
                ) -> torch.Tensor:
        """hidden_in (T, hidden): the previous pipeline stage's output (None on the first
        stage: the embeddings). The last stage returns the final hidden states; the others
        hidden + residual after their last layer (distributed/pipeline.py: the next layer's
        add + RMSNorm takes the sum as it would take the pair)."""
        if hidden_in is None:
            hidden = self.embed_tokens(input_ids)  # (T, hidden)
            if self.embed_scale is not None:  # (as transformers: the scale in hidden's dtype)
                hidden = hidden * torch.tensor(self.embed_scale, dtype=hidden.dtype)
        else:
            hidden = hidden_in
        residual = None
        # rope key → cos, sin (T, 1, D)
        tables = {key: emb(positions, hidden.dtype) for key, emb in self.rotary_embs.items()}
        fused = self.fused_layers
        if fused is not None and fused.applies(hidden, meta):
            hidden, residual = fused.run(hidden, tables, meta)
        else:
            for layer in self.local_layers():
                hidden, residual = layer(tables[layer.rope_key], hidden, residual, meta)
        if not self.pp_last:
            return hidden + residual
        hidden, _ = self.norm(hidden, residual)
        return hidden


class LlamaForCausalLM(nn.Module):
    # checkpoint module name → (our merged module, shard id)
    packed_modules_mapping = {
        "q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
    }
    attention_cls: type[LlamaAttention] = LlamaAttention
    # a decoder layer's feed-forward block: (config, tp, quant, prefix, layer_idx) → module
    mlp_cls: Callable[..., nn.Module] = LlamaMLP
    layer_cls: type[LlamaDecoderLayer] = LlamaDecoderLayer
    norm_cls: type[RMSNorm] = RMSNorm

    def __init__(self, config: Any, tp: ParallelState = ParallelState(),
                 quant_config: QuantizationConfig | None = None) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config, tp, quant_config, self.attention_cls, self.mlp_cls,
                                self.layer_cls, self.norm_cls, self._embed_scale(config),
                                **self._attention_flags(config))
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        # A tied head multiplies with the embedding's table: its method is the embedding's.
        self.lm_head = (ParallelLMHead(
            config.vocab_size, config.hidden_size, tp, quant_config,
            prefix="model.embed_tokens" if self.tie_word_embeddings else "lm_head")
            if tp.is_last_stage else PPMissingLayer())
        if self.tie_word_embeddings and tp.is_last_stage:
            self.lm_head.tie_to(self.model.embed_tokens)

    def _attention_flags(self, config: Any) -> dict[str, bool]:
        bias = bool(getattr(config, "attention_bias", False))
        return {"qkv_bias": bias, "o_bias": bias}

    def _embed_scale(self, config: Any) -> float | None:
        return None

    def attention_layers(self) -> list[Attention]:
        """This stage's layers' attention (all of them without pipeline parallelism)."""
        return [layer.self_attn.attn for layer in self.model.local_layers()]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                meta: AttentionMetadata, hidden_in: torch.Tensor | None = None
                ) -> torch.Tensor:
        """input_ids, positions (T,) → final hidden states (T, hidden); under pipeline
        parallelism from / to the neighbouring stages (LlamaModel.forward)."""
        return self.model(input_ids, positions, meta, hidden_in)

    def compute_logits(self, hidden: torch.Tensor, logits_indices: torch.Tensor) -> torch.Tensor:
        return self.lm_head.compute_logits(hidden, logits_indices)


class Qwen2ForCausalLM(LlamaForCausalLM):
    def _attention_flags(self, config: Any) -> dict[str, bool]:
        return {"qkv_bias": True, "o_bias": False}
