"""RequestIntake: a request from what a caller sends to a PreparedRequest the engine can queue.

Tokenizes (text, token ids or {"prompt": ..., "prompt_token_ids": ...}), refuses text too long
to fit before tokenizing it, validates every field against the model and the KV cache (a
ValueError names the field), resolves max_tokens and compiles a structured-output grammar.
It touches nothing the engine thread owns (the KV cache's size is fixed), so servers run it
off the event loop and off the engine thread; and every data-parallel replica would answer the
same (engine/data_parallel.py tokenizes once, on replica 0).
"""

from __future__ import annotations

import dataclasses
import functools
import time
from dataclasses import dataclass
from typing import Any

from tokenmill.config import ModelConfig
from tokenmill.core.kv_cache_manager import KVCacheManager
from tokenmill.lora.registry import AdapterRegistry
from tokenmill.lora.request import AdapterRef, LoRARequest
from tokenmill.pooling_params import PoolerConfig, PoolingParams
from tokenmill.reasoning.gate import ReasoningTokens
from tokenmill.sampling_params import SamplingParams
from tokenmill.structured_output.backend import CompiledGrammar
from tokenmill.structured_output.manager import StructuredOutputManager
from tokenmill.utils import cdiv


@dataclass(frozen=True)
class PreparedRequest:
    """A validated, tokenized request, ready for `LLMEngine.add_prepared`."""

    request_id: str
    prompt: str | None
    token_ids: list[int]
    params: SamplingParams
    max_tokens: int
    arrival_time: float
    grammar: CompiledGrammar | None = None  # structured outputs: each sample gets a matcher
    pooling: PoolingParams | None = None  # an embedding request (params then unused), resolved
    lora: AdapterRef | None = None  # the LoRA adapter it runs with, checked
    priority: int = 0  # lower is served first (scheduling_policy "priority")
    # bad_words as token sequences (vLLM's rule: each word alone and after a space)
    bad_words: tuple[tuple[int, ...], ...] = ()


class RequestIntake:
    def __init__(self, model: ModelConfig, tokenizer: Any, kv: KVCacheManager,
                 structured: StructuredOutputManager, runner: str = "auto",
                 pooler: PoolerConfig | None = None, adapters: AdapterRegistry | None = None,
                 scheduling_policy: str = "fcfs", reasoning: ReasoningTokens | None = None
                 ) -> None:
        self.scheduling_policy = scheduling_policy
        self.reasoning = reasoning  # the reasoning tags' tokens (thinking budgets, gates)
        self.model, self.tokenizer, self.kv, self.structured = model, tokenizer, kv, structured
        self.runner, self.pooler = runner, pooler or PoolerConfig()
        self.adapters = adapters or AdapterRegistry(model.hf_config, None)

    def prepare(self, request_id: str, prompt: str | list[int] | dict[str, Any],
                params: SamplingParams | PoolingParams | None = None,
                arrival_time: float | None = None,
                lora_request: LoRARequest | None = None, priority: int = 0
                ) -> PreparedRequest:
        arrival = time.monotonic() if arrival_time is None else arrival_time
        self._check_priority(priority)
        if isinstance(params, PoolingParams):
            if lora_request is not None:
                raise ValueError("lora_request: embeddings are computed by the base model")
            return dataclasses.replace(
                self._prepare_embedding(request_id, prompt, params, arrival), priority=priority)
        if self.runner == "pooling":
            raise ValueError("this engine runs embedding models (runner='pooling'): it "
                             "embeds prompts and does not generate; start it with "
                             "runner='generate' or 'auto' to generate")
        params = params or SamplingParams()
        self._check_logprobs(params)
        prompt_text, token_ids = self._split_prompt(prompt)
        keep = params.truncate_prompt_tokens
        if keep is not None:  # vLLM's: the prompt's last tokens (-1: max_model_len of them)
            keep = self.model.max_model_len if keep == -1 else keep
            if len(token_ids) > keep:
                prompt_text, token_ids = None, token_ids[-keep:]
        max_tokens = self._validate(token_ids, params)
        if params.top_k >= self.model.vocab_size:  # the same draw, in the range of ops
            params = dataclasses.replace(params, top_k=0)
        lora = self.adapters.resolve(lora_request)
        grammar = (self.structured.compile(params.structured_outputs)
                   if params.structured_outputs is not None else None)
        grammar = self._gate(grammar, params.thinking_token_budget, token_ids)
        return PreparedRequest(request_id, prompt_text, token_ids, params, max_tokens, arrival,
                               grammar, lora=lora, priority=priority,
                               bad_words=self._bad_words(params.bad_words or ()))

    def _gate(self, grammar: CompiledGrammar | None, budget: int | None,
              token_ids: list[int]) -> CompiledGrammar | None:
        """The grammar behind the request's reasoning, with its thinking budget (vLLM's:
        reasoning/gate.py); ValueError for a budget without the engine's reasoning tags."""
        if self.reasoning is None:
            if budget is not None:
                raise ValueError("thinking_token_budget needs the engine's reasoning tags: "
                                 "start it with --reasoning-parser (or --reasoning-config)")
            return grammar
        return self.reasoning.gate(grammar, budget, token_ids)

    def _bad_words(self, words: list[str]) -> tuple[tuple[int, ...], ...]:
        """Each word's token sequences as vLLM bans them: the word alone (leading spaces
        dropped), and after a space where that spells it with another first token in as
        many tokens (a word-start token)."""
        seqs: list[tuple[int, ...]] = []
        for word in words:
            alone = tuple(self.tokenizer.encode(word.lstrip(), add_special_tokens=False))
            spaced = tuple(self.tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
            seqs += [alone] + ([spaced] if spaced[0] != alone[0]
                               and len(spaced) == len(alone) else [])
        return tuple(dict.fromkeys(seqs))

    def _check_logprobs(self, params: SamplingParams) -> None:
        cap = self.model.max_logprobs
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(params, name)
            if value is not None and value > cap:
                raise ValueError(f"{name} must be at most {cap} (the engine's max_logprobs; "
                                 f"--max-logprobs raises it), got {value}")

    def _check_priority(self, priority: int) -> None:
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise ValueError(f"priority must be an integer, got {priority!r}")
        if priority != 0 and self.scheduling_policy != "priority":
            raise ValueError(f"priority {priority} needs the priority scheduling policy "
                             "(scheduling_policy='priority', --scheduling-policy priority)")

    def _prepare_embedding(self, request_id: str, prompt: str | list[int] | dict[str, Any],
                           params: PoolingParams, arrival: float) -> PreparedRequest:
        """An embedding request: its prompt is checked as a generating one's, without the
        room to generate (it computes its prompt and ends)."""
        if self.runner == "generate":
            raise ValueError("this engine generates (runner='generate'); start it with "
                             "runner='pooling' or 'auto' to compute embeddings")
        prompt_text, token_ids = self._split_prompt(prompt)
        self._check_prompt(token_ids)
        n, max_len = len(token_ids), self.model.max_model_len
        if n > max_len:
            raise ValueError(f"prompt ({n} tokens) exceeds the context length "
                             f"max_model_len={max_len}")
        if cdiv(n, self.kv.block_size) > self.kv.num_usable_blocks:
            raise ValueError(f"prompt ({n} tokens) needs more KV blocks than the cache has "
                             f"({self.kv.num_usable_blocks}); raise kv_cache_memory")
        pooling = params.resolve(self.pooler, self.model.hf_config.hidden_size)
        return PreparedRequest(request_id, prompt_text, token_ids, SamplingParams(max_tokens=1),
                               0, arrival, pooling=pooling)

    def _check_prompt(self, token_ids: list[int]) -> None:
        if not token_ids:
            raise ValueError("prompt is empty: it must have at least 1 token")
        vocab = self.model.vocab_size
        if any(not isinstance(t, int) or not 0 <= t < vocab for t in token_ids):
            raise ValueError(f"prompt token ids must be integers in [0, {vocab})")

    def _split_prompt(self, prompt: str | list[int] | dict[str, Any]
                      ) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            text, ids = prompt.get("prompt"), prompt.get("prompt_token_ids")
            if ids is None and not isinstance(text, str):
                raise ValueError("a prompt dict needs 'prompt' (text) or 'prompt_token_ids'")
            return text, list(ids) if ids is not None else self.encode(text)
        if isinstance(prompt, str):
            return prompt, self.encode(prompt)
        if isinstance(prompt, list | tuple):
            return None, list(prompt)
        raise ValueError(f"prompt must be a string, a list of token ids or a dict, "
                         f"got {type(prompt).__name__}")

    def encode(self, text: str) -> list[int]:
        self.check_text_length(len(text))
        return self.tokenizer.encode(text, add_special_tokens=True)

    def check_text_length(self, num_chars: int) -> None:
        """ValueError, before any tokenizing, for text too long to fit the context: no token
        covers more characters than the vocabulary's longest entry (doubled for normalizers),
        so such text needs more than max_model_len tokens. Tokenizing megabytes would hold a
        worker for seconds only to refuse the request after."""
        max_len = self.model.max_model_len
        limit = 2 * self._max_token_chars * max_len
        if num_chars > limit:
            raise ValueError(f"prompt is too long: {num_chars} characters cannot fit in "
                             f"max_model_len={max_len} tokens")

    @functools.cached_property
    def _max_token_chars(self) -> int:
        vocab = self.tokenizer.get_vocab()
        return max((len(t) for t in vocab), default=1)

    def _validate(self, token_ids: list[int], params: SamplingParams) -> int:
        """The request's resolved max_tokens; ValueError for anything it cannot be served with."""
        max_len = self.model.max_model_len
        n = len(token_ids)
        self._check_prompt(token_ids)
        vocab = self.model.vocab_size
        bad_bias = [t for t in params.logit_bias if t >= vocab]
        if bad_bias:
            raise ValueError(f"logit_bias token ids must be < vocab size {vocab}, got {bad_bias}")
        bad_allowed = [t for t in params.allowed_token_ids or () if t >= vocab]
        if bad_allowed:
            raise ValueError(f"allowed_token_ids must be < vocab size {vocab}, got "
                             f"{bad_allowed}")
        bad_stop = [t for t in params.stop_token_ids if t >= vocab]
        if bad_stop:
            raise ValueError(f"stop_token_ids must be < vocab size {vocab}, got {bad_stop}")
        # No max_tokens given: up to the context length, or as much as the KV cache can hold
        # for one request if that is less (a request must fit the cache to make progress),
        # or the model's own max_new_tokens (its generation config) if that is less still.
        capacity = self.kv.num_usable_blocks * self.kv.block_size
        max_tokens = (params.max_tokens if params.max_tokens is not None
                      else min(min(max_len, capacity) - n,
                               self.model.sampling_defaults.get("max_tokens", max_len)))
        if n + max_tokens > max_len:
            raise ValueError(f"prompt ({n} tokens) + max_tokens ({max_tokens}) = "
                             f"{n + max_tokens} exceeds the context length "
                             f"max_model_len={max_len}")
        if max_tokens < 1:
            raise ValueError(f"prompt ({n} tokens) leaves no room to generate within "
                             f"max_model_len={max_len} and a KV cache of {capacity} tokens")
        need = cdiv(n + max_tokens, self.kv.block_size)
        if need > self.kv.num_usable_blocks:
            raise ValueError(f"prompt + max_tokens = {n + max_tokens} tokens need {need} KV "
                             f"blocks but the cache has {self.kv.num_usable_blocks}; raise "
                             "kv_cache_memory or lower max_tokens")
        return max_tokens
