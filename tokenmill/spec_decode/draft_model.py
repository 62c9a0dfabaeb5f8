"""DraftModelProposer: a cheaper model drafts tokens for the target to verify (method
"draft_model"): a smaller checkpoint with the same vocabulary, or the target's own checkpoint
in a cheaper weight format (self-speculation: the GGUF blocks or int8 drafting for float32).

It runs in the model runner right after the target's step has sampled: for each request the
scheduler asked (`ScheduledRequest.num_lookahead_tokens` = k > 0), it feeds the tokens its cache
lacks (the whole prompt the first time, then the one or two tokens the last step added) and
then k - 1 of its own drafts, one forward per draft; the drafts go back in
`ModelRunnerOutput.draft_token_ids` and the scheduler schedules them the next step. A greedy
request's drafts are the draft model's argmax (one-hot proposals, as n-gram drafts are); a
sampled request's are drawn from q, the distribution its own temperature, top-k, top-p and
min-p make of the draft's logits, and q goes along (`draft_probs`) so that the rejection
sampler accepts with min(1, p/q), which keeps the target's distribution and accepts more
often than treating the draws as one-hot would (sum min(p, q) against sum p q).

KV cache: its own tensors with one block per target block, addressed by the same block tables
(the scheduler reserves k lookahead slots for the drafts' K/V), so one block budget covers both
models and block copies apply to both. Invariant: for positions < `_DraftState.valid` the
draft's K/V are those of the request's tokens there. Nothing the target emits depends on the
draft's K/V (only how many drafts it accepts), so a request whose blocks moved (preemption,
swap) simply starts over: the runner calls `forget`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from tokenmill.attention.base import AttentionBackend
from tokenmill.attention.input_batch import InputBatch
from tokenmill.attention.kv_cache import allocate_kv_cache, bytes_per_block
from tokenmill.config import ModelConfig
from tokenmill.core.interface import ScheduledRequest
from tokenmill.layers import cpu_ops
from tokenmill.layers.sampler import Sampler
from tokenmill.layers.sampling_batch import SamplingBatch
from tokenmill.model_loader.loader import load_model
from tokenmill.models.cpu_decode import attach_fused_layers
from tokenmill.sampling_params import SamplingParams
from tokenmill.utils.huge_pages import move_parameters_to_huge_pages


def _draft_params(params: SamplingParams) -> SamplingParams:
    """A request's sampling parameters for drafting: no logprobs to compute, and a seed of
    its own (the target's stream and the draft's must not be the same numbers)."""
    seed = None if params.seed is None else params.seed ^ _DRAFT_SEED_SALT
    return dataclasses.replace(params, seed=seed, logprobs=None, prompt_logprobs=None)


_DRAFT_SEED_SALT = 0x5DEECE66D


@dataclass
class _DraftState:
    valid: int  # positions whose draft K/V match the request's tokens
    pending: list[int]  # drafts whose K/V it also wrote from `valid` on: valid once accepted


class DraftModelProposer:
    def __init__(self, config: ModelConfig, num_blocks: int, block_size: int,
                 device: torch.device, backend: AttentionBackend,
                 prepack: bool | str = "auto", seed: int = 0,
                 batch_invariant: bool = True) -> None:
        self.config, self.block_size, self.device = config, block_size, device
        self.model = load_model(config, device, prepack=prepack, batch_invariant=batch_invariant)
        attach_fused_layers(self.model, device)
        if device.type == "cpu":
            move_parameters_to_huge_pages(self.model)
        self.kv_cache = allocate_kv_cache(config.num_layers, num_blocks, block_size,
                                          config.num_kv_heads, config.head_dim, config.dtype,
                                          device)
        self.backend = backend
        for i, attn in enumerate(self.model.attention_layers()):
            attn.bind(self.kv_cache[i], backend)
        self._states: dict[str, _DraftState] = {}
        # draws sampled requests' drafts; a seeded request's from a stream of its own,
        # seeded apart from the target's (_draft_params), so its output stays reproducible
        self.sampler = Sampler(seed, device)

    @staticmethod
    def block_bytes(config: ModelConfig, block_size: int) -> int:
        return bytes_per_block(config.num_layers, block_size, config.num_kv_heads,
                               config.head_dim, config.dtype)

    def forget(self, req_ids: set[str] | list[str], finished: bool = True) -> None:
        """Drop requests whose blocks moved (their draft K/V are lost) or that `finished`
        (their random streams too)."""
        for rid in req_ids:
            self._states.pop(rid, None)
        if finished:
            self.sampler.forget(set(req_ids))

    def _valid_prefix(self, req_id: str, tokens: list[int]) -> int:
        """How many leading positions of `tokens` the draft's K/V already cover (at most all
        but the last token, which must be fed to draft the next one)."""
        state = self._states.get(req_id)
        if state is None:
            return 0
        valid = state.valid
        for t in state.pending:
            if valid >= len(tokens) or tokens[valid] != t:
                break
            valid += 1
        return min(valid, len(tokens) - 1)

    @torch.inference_mode()
    def propose(self, reqs: list[ScheduledRequest], sampled: list[list[int]]
                ) -> tuple[dict[str, list[int]], dict[str, torch.Tensor]]:
        """Drafts for the requests of this step that sampled and asked for some, and for the
        sampled requests among them the distributions q they were drawn from ((k, V) each)."""
        feeds: list[ScheduledRequest] = []  # this forward's queries, one per drafting request
        wanted: list[int] = []
        lengths: list[int] = []
        for r, new in zip(reqs, sampled, strict=True):
            if not new or r.num_lookahead_tokens <= 0:
                continue
            tokens = r.prompt_token_ids + r.output_token_ids + new  # after this step
            start = self._valid_prefix(r.req_id, tokens)
            feeds.append(ScheduledRequest(req_id=r.req_id, token_ids=tokens[start:],
                                          start_pos=start, block_ids=r.block_ids, sample=True,
                                          sampling_params=_draft_params(r.sampling_params)))
            wanted.append(r.num_lookahead_tokens)
            lengths.append(len(tokens))
        drafts: list[list[int]] = [[] for _ in feeds]
        probs: list[list[torch.Tensor]] = [[] for _ in feeds]
        active = list(range(len(feeds)))
        while active:
            rows = [feeds[i] for i in active]
            batch = InputBatch.build(rows, self.block_size, self.device)
            meta = self.backend.build_metadata(batch)
            hidden = self.model(batch.input_ids, batch.positions, meta)  # (T, hidden)
            logits = self.model.compute_logits(hidden, batch.logits_indices)  # (B, V)
            tokens, q = self._sample(logits, rows)
            for j, (i, t) in enumerate(zip(active, tokens, strict=True)):
                drafts[i].append(t)
                if q is not None and not rows[j].sampling_params.is_greedy:
                    probs[i].append(q[j])
                feeds[i] = dataclasses.replace(rows[j], token_ids=[t], start_pos=rows[j]
                                               .start_pos + rows[j].num_tokens)
            active = [i for i in active if len(drafts[i]) < wanted[i]]
        for f, d, n in zip(feeds, drafts, lengths, strict=True):
            # K/V written: the request's tokens, then the drafts but the last
            self._states[f.req_id] = _DraftState(valid=n, pending=d[:-1])
        return ({f.req_id: d for f, d in zip(feeds, drafts, strict=True)},
                {f.req_id: torch.stack(ps) for f, ps in zip(feeds, probs, strict=True) if ps})

    def _sample(self, logits: torch.Tensor, rows: list[ScheduledRequest]
                ) -> tuple[list[int], torch.Tensor | None]:
        """Each row's draft (greedy rows: the argmax; sampled rows: a draw from q, the
        distribution their own temperature, top-k, top-p and min-p make of the draft's
        logits), and q (B, V) where any row is sampled."""
        b = SamplingBatch.build(rows, logits.shape[-1], logits.device)
        _, target = self.sampler.target_logits(logits, b)
        greedy = cpu_ops.argmax(target)
        if b.all_greedy:
            return greedy.tolist(), None
        q = Sampler.probs(target, b)
        drawn = cpu_ops.argmax(q / self.sampler.noise(q, b, rows))
        return torch.where(b.is_greedy, greedy, drawn).tolist(), q
