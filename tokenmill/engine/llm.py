"""LLM: the offline batch API, vLLM-compatible. It holds an LLMEngine (composition, not a
subclass) and drives it until every submitted request has finished.

    llm = LLM()                                   # default model: SmolLM2-135M-Instruct
    outs = llm.generate(["Hello"], SamplingParams(max_tokens=32))
    outs = llm.chat([{"role": "user", "content": "Hi"}])
    embs = LLM(model, runner="pooling").embed(["Hello"])   # embs[0].outputs.embedding
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence
from typing import Any

from tqdm.auto import tqdm

from tokenmill.engine.beam_search import BeamSearchOutput, beam_search
from tokenmill.engine.chat_content import as_content, content_format
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.engine.tokenizer import chat_template_of
from tokenmill.engine_args import EngineArgs
from tokenmill.lora.request import LoRARequest
from tokenmill.outputs import EmbeddingRequestOutput, RequestOutput
from tokenmill.pooling_params import PoolingParams
from tokenmill.sampling_params import BeamSearchParams, RequestOutputKind, SamplingParams

PromptType = str | list[int] | dict[str, Any]


class LLM:
    def __init__(self, model: str | None = None, **engine_options: Any) -> None:
        """`engine_options`: EngineArgs' fields (engine_args.py, vLLM's names)."""
        args = EngineArgs.from_options(model, **engine_options)
        if args.data_parallel_size > 1:
            raise ValueError("data_parallel_size > 1 runs engine replicas behind one API server "
                             "(tokenmill serve --data-parallel-size D); an offline LLM is one "
                             "engine: run one LLM per process for offline data parallelism")
        self.engine = LLMEngine.from_engine_args(args, offline=True)
        self._ids = itertools.count()

    def get_tokenizer(self) -> Any:
        return self.engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """What `generate` and `chat` run without sampling_params (vLLM's): the model's
        generation-config defaults (engine option generation_config), else SamplingParams()."""
        defaults = dict(self.engine.config.model.sampling_defaults)
        if "max_tokens" in defaults:  # the model's max_new_tokens, within the context's room
            defaults["max_tokens"] = None  # (the engine's intake caps None by it)
        return SamplingParams(**defaults)

    def reset_prefix_cache(self) -> bool:
        """Drop every cached prompt prefix (vLLM's name): the next prompts are computed from
        scratch. Returns False, changing nothing, while requests are running."""
        return self.engine.reset_prefix_cache()

    def sleep(self, level: int = 1) -> None:
        """Release the KV cache and the weights until `wake_up` (vLLM's; needs
        enable_sleep_mode=True): level 1 or 2 (worker/sleep_mode.py)."""
        self.engine.sleep(level)

    def wake_up(self) -> None:
        self.engine.wake_up()

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True,
                 lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
                 priority: Sequence[int] | None = None) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in input order. `lora_request`:
        one adapter for every prompt, or one (or None) per prompt (enable_lora engines);
        `priority`: one per prompt, lower served first (scheduling_policy="priority")."""
        return self._run(self._submit(prompts, sampling_params, SamplingParams, lora_request,
                                      priority), use_tqdm)

    def embed(self, prompts: PromptType | Sequence[PromptType],
              pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
              use_tqdm: bool = True) -> list[EmbeddingRequestOutput]:
        """One embedding per prompt (`outputs.embedding`), in input order, batched by the
        scheduler with whatever else runs (vLLM's LLM.embed; pooling per the engine's
        pooler_config)."""
        return self._run(self._submit(prompts, pooling_params, PoolingParams), use_tqdm)

    def _submit(self, prompts: PromptType | Sequence[PromptType], params: Any,
                kind: type, lora_request: Any = None, priority: Any = None) -> list[str]:
        """Add every prompt with its params (one for all, one each, or None: kind()),
        adapter (likewise) and priority (one each, or None: 0); the request ids. A prompt
        refused aborts those added before it."""
        prompts = _as_prompt_list(prompts)
        if params is None and kind is SamplingParams:
            params = self.get_default_sampling_params()
        params = _as_params_list(params, len(prompts), kind)
        if kind is SamplingParams:
            params = _final_only(params)
        loras = _as_lora_list(lora_request, len(prompts))
        priorities = [0] * len(prompts) if priority is None else list(priority)
        if len(priorities) != len(prompts):
            raise ValueError(f"got {len(priorities)} priorities for {len(prompts)} prompts; "
                             "pass one per prompt")
        request_ids = []
        try:
            for prompt, p, lora, prio in zip(prompts, params, loras, priorities, strict=True):
                rid = str(next(self._ids))
                if kind is PoolingParams:
                    self.engine.add_request(rid, prompt, p)
                else:
                    self.engine.add_request(rid, prompt, p, lora_request=lora, priority=prio)
                request_ids.append(rid)
        except Exception:
            for rid in request_ids:  # leave the engine as we found it
                self.engine.abort_request(rid)
            raise
        return request_ids

    def chat(self, messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True, add_generation_prompt: bool = True,
             chat_template_kwargs: dict[str, Any] | None = None,
             lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
             priority: Sequence[int] | None = None,
             chat_template: str | None = None,
             chat_template_content_format: str | None = None) -> list[RequestOutput]:
        """Apply the chat template to one conversation or a list of them, then generate.
        `chat_template` (vLLM's): the template's text for this call; else the engine's
        chat_template option, else the tokenizer's. `chat_template_content_format`
        (vLLM's): how messages' content reaches it (engine/chat_content.py); else the
        engine's option."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        tok = self.get_tokenizer()
        template = chat_template or chat_template_of(self.engine.config.model, tok)
        if not template:
            raise ValueError("this model's tokenizer has no chat template; pass chat_template "
                             "or use generate()")
        fmt = content_format(template, chat_template_content_format
                             or self.engine.config.model.chat_template_content_format)
        prompts = [tok.apply_chat_template(
            [m | {"content": as_content(m.get("content"), fmt)} for m in conv],
            chat_template=template, tokenize=False,
            add_generation_prompt=add_generation_prompt, **(chat_template_kwargs or {}))
            for conv in conversations]
        # The template already holds the special tokens (BOS etc.): do not add them twice.
        token_prompts = [{"prompt": text,
                          "prompt_token_ids": tok.encode(text, add_special_tokens=False)}
                         for text in prompts]
        return self.generate(token_prompts, sampling_params, use_tqdm, lora_request, priority)

    def beam_search(self, prompts: PromptType | Sequence[PromptType],
                    params: BeamSearchParams) -> list[BeamSearchOutput]:
        """Beam search with Hugging Face's rules; sequences come back best first."""
        prompts = _as_prompt_list(prompts)
        check = SamplingParams(max_tokens=params.max_tokens)  # tokenizes and validates
        token_prompts = [self.engine.prepare_request("beam", p, check).token_ids
                         for p in prompts]
        outputs = beam_search(lambda ps, sp: self.generate(ps, sp, use_tqdm=False),
                              token_prompts, params, self.engine.eos_token_ids)
        tok = self.get_tokenizer()
        for out, prompt in zip(outputs, token_prompts, strict=True):
            for seq in out.sequences:
                seq.text = tok.decode(seq.tokens[len(prompt):], skip_special_tokens=True)
                ended_on_eos = (not params.ignore_eos and len(seq.tokens) > len(prompt)
                                and seq.tokens[-1] in self.engine.eos_token_ids)
                seq.finish_reason = "stop" if ended_on_eos else "length"
        return outputs

    def _run(self, request_ids: list[str], use_tqdm: bool) -> list[Any]:
        order = {rid: i for i, rid in enumerate(request_ids)}
        results: list[Any] = [None] * len(request_ids)
        bar = tqdm(total=len(request_ids), desc="Processed prompts", disable=not use_tqdm,
                   dynamic_ncols=True)
        try:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.finished and out.request_id in order:
                        results[order[out.request_id]] = out
                        bar.update(1)
        except BaseException:
            for rid in request_ids:
                self.engine.abort_request(rid)
            raise
        finally:
            bar.close()
        return [r for r in results if r is not None]


def _as_prompt_list(prompts: PromptType | Sequence[PromptType]) -> list[PromptType]:
    if isinstance(prompts, str | dict):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]  # a single prompt given as token ids
    return prompts


def _final_only(params: list[SamplingParams]) -> list[SamplingParams]:
    """The params asking for the final output only (as vLLM's LLM does: generate returns
    nothing else, so no output is built for the steps in between); copies, the caller's
    objects are left as they were."""
    copies: dict[int, SamplingParams] = {}
    for p in params:
        if id(p) not in copies:
            copies[id(p)] = (p if p.output_kind is RequestOutputKind.FINAL_ONLY else
                             dataclasses.replace(p, output_kind=RequestOutputKind.FINAL_ONLY))
    return [copies[id(p)] for p in params]


def _as_lora_list(lora_request: Any, n: int) -> list[LoRARequest | None]:
    """One adapter (or None) per prompt."""
    if lora_request is None or isinstance(lora_request, LoRARequest):
        return [lora_request] * n
    loras = list(lora_request)
    if len(loras) != n:
        raise ValueError(f"got {len(loras)} lora_request entries for {n} prompts; pass one, "
                         "or one per prompt")
    if not all(x is None or isinstance(x, LoRARequest) for x in loras):
        raise ValueError("lora_request entries must be LoRARequest objects or None")
    return loras


def _as_params_list(params: Any, n: int, kind: type = SamplingParams) -> list[Any]:
    """One params object per prompt, of `kind` (SamplingParams or PoolingParams)."""
    if params is None:
        return [kind()] * n
    if isinstance(params, kind):
        return [params] * n
    params = list(params)
    field = "sampling_params" if kind is SamplingParams else "pooling_params"
    if len(params) != n:
        raise ValueError(f"got {len(params)} {field} for {n} prompts; pass one, or one per "
                         "prompt")
    if not all(isinstance(p, kind) for p in params):
        raise ValueError(f"{field} must be {kind.__name__} objects")
    return params
