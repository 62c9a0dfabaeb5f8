"""DraftModelProposer: a cheaper model drafts tokens for the target to verify (method
"draft_model"): a smaller checkpoint with the same vocabulary, or the target's own checkpoint
in a cheaper weight format (self-speculation: the GGUF blocks or int8 drafting for float32).

It runs in the model runner right after the target's step has sampled: for each request the
scheduler asked (`ScheduledRequest.num_lookahead_tokens` = k > 0), it feeds the tokens its cache
lacks (the whole prompt the first time, then the one or two tokens the last step added) and
then k - 1 of its own drafts, one forward per draft, greedy; the drafts go back in
`ModelRunnerOutput.draft_token_ids` and the scheduler schedules them the next step. A greedy
draft is a one-hot proposal, which the rejection sampler takes as it takes n-gram drafts, so
sampled output keeps the target's distribution.

KV cache: its own tensors with one block per target block, addressed by the same block tables
(the scheduler reserves k lookahead slots for the drafts' K/V), so one block budget covers both
models and block copies apply to both. Invariant: for positions < `_DraftState.valid` the
draft's K/V are those of the request's tokens there. Nothing the target emits depends on the
draft's K/V (only how many drafts it accepts), so a request whose blocks moved (preemption,
swap) simply starts over: the runner calls `forget`.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

import torch

from tokenmill.attention.base import AttentionBackend
from tokenmill.attention.kv_cache import allocate_kv_cache, bytes_per_block
from tokenmill.config import ModelConfig
from tokenmill.core.interface import ScheduledRequest, SchedulerOutput
from tokenmill.model_loader import load_model
from tokenmill.spec_decode.config import SpeculativeConfig
from tokenmill.utils.huge_pages import move_parameters_to_huge_pages
from tokenmill.worker.input_batch import InputBatch


def draft_model_config(spec: SpeculativeConfig, target: ModelConfig, device: str) -> ModelConfig:
    """The draft's ModelConfig, checked against the target (same vocabulary, its context)."""
    from tokenmill.quantization import default_quantization

    path = target.path if spec.model is None else os.path.expanduser(spec.model)
    try:
        draft = ModelConfig.from_path(path, dtype=str(target.dtype).removeprefix("torch."),
                                      max_model_len=target.max_model_len,
                                      quantization=spec.quantization)
    except ValueError as e:
        raise ValueError(f"speculative draft model: {e}") from None
    if spec.quantization is None:
        draft = dataclasses.replace(draft, quantization=default_quantization(draft, device))
    if draft.vocab_size != target.vocab_size:
        raise ValueError(f"speculative draft model {path} has a vocabulary of "
                         f"{draft.vocab_size} tokens, the target {target.vocab_size}: a draft "
                         "must share the target's tokenizer")
    if (os.path.realpath(draft.path) == os.path.realpath(target.path)
            and draft.quantization == target.quantization):
        raise ValueError(f"speculative draft model: {path} in weight format "
                         f"{draft.quantization or 'dense'} is the target itself; pass a "
                         "smaller model or a cheaper 'quantization' (e.g. 'gguf', 'int8')")
    return draft


@dataclass
class _DraftState:
    valid: int  # positions whose draft K/V match the request's tokens
    pending_start: int  # the draft also wrote K/V for `pending` from this position on,
    pending: list[int]  # its own unverified drafts: valid once the target accepts them


class DraftModelProposer:
    def __init__(self, config: ModelConfig, num_blocks: int, block_size: int,
                 device: torch.device, backend: AttentionBackend,
                 prepack: bool | str = "auto") -> None:
        self.config, self.block_size, self.device = config, block_size, device
        self.model = load_model(config, device, prepack=prepack)
        if device.type == "cpu":
            move_parameters_to_huge_pages(self.model)
        self.kv_cache = allocate_kv_cache(config.num_layers, num_blocks, block_size,
                                          config.num_kv_heads, config.head_dim, config.dtype,
                                          device)
        self.backend = backend
        for i, attn in enumerate(self.model.attention_layers()):
            attn.bind(self.kv_cache[i], backend)
        self._states: dict[str, _DraftState] = {}

    @staticmethod
    def block_bytes(config: ModelConfig, block_size: int) -> int:
        return bytes_per_block(config.num_layers, block_size, config.num_kv_heads,
                               config.head_dim, config.dtype)

    def forget(self, req_ids: set[str] | list[str]) -> None:
        """Drop requests that finished or whose blocks moved (their draft K/V are lost)."""
        for rid in req_ids:
            self._states.pop(rid, None)

    def _valid_prefix(self, req_id: str, tokens: list[int]) -> int:
        """How many leading positions of `tokens` the draft's K/V already cover (at most all
        but the last token, which must be fed to draft the next one)."""
        state = self._states.get(req_id)
        if state is None:
            return 0
        valid = state.valid
        for j, t in enumerate(state.pending):
            pos = state.pending_start + j
            if pos != valid or pos >= len(tokens) or tokens[pos] != t:
                break
            valid += 1
        return min(valid, len(tokens) - 1)

    @torch.inference_mode()
    def propose(self, sched: SchedulerOutput, sampled: list[list[int]]) -> dict[str, list[int]]:
        """Drafts for the requests of this step that sampled and asked for some."""
        feeds: list[ScheduledRequest] = []  # this forward's queries, one per drafting request
        wanted: list[int] = []
        lengths: list[int] = []
        for r, new in zip(sched.scheduled, sampled, strict=True):
            if not new or r.num_lookahead_tokens <= 0:
                continue
            tokens = r.prompt_token_ids + r.output_token_ids + new  # after this step
            start = self._valid_prefix(r.req_id, tokens)
            feeds.append(ScheduledRequest(req_id=r.req_id, token_ids=tokens[start:],
                                          start_pos=start, block_ids=r.block_ids, sample=True,
                                          sampling_params=r.sampling_params))
            wanted.append(r.num_lookahead_tokens)
            lengths.append(len(tokens))
        drafts: list[list[int]] = [[] for _ in feeds]
        active = list(range(len(feeds)))
        while active:
            step = SchedulerOutput(scheduled=[feeds[i] for i in active])
            batch = InputBatch.build(step, self.block_size, self.device)
            meta = self.backend.build_metadata(batch)
            hidden = self.model(batch.input_ids, batch.positions, meta)  # (T, hidden)
            logits = self.model.compute_logits(hidden, batch.logits_indices)  # (B, V)
            for i, t in zip(active, logits.argmax(dim=-1).tolist(), strict=True):
                drafts[i].append(t)
                f = feeds[i]
                feeds[i] = dataclasses.replace(f, token_ids=[t], start_pos=f.start_pos
                                               + f.num_tokens)
            active = [i for i in active if len(drafts[i]) < wanted[i]]
        for f, d, n in zip(feeds, drafts, lengths, strict=True):
            # K/V written: the request's tokens, then the drafts but the last
            self._states[f.req_id] = _DraftState(valid=n, pending_start=n, pending=d[:-1])
        return {f.req_id: d for f, d in zip(feeds, drafts, strict=True)}
