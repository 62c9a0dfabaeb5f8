"""thinking_token_budget and grammars behind the reasoning, through the engine on the tiny
Llama: greedy output equals Hugging Face's greedy loop with the end of thinking appended
after `budget` reasoning tokens (alone, batched with other budgets, with and without
jump-forward, under n-gram drafts); a grammar constrains only the answer after the reasoning
(from the first token with enable_in_reasoning); qwen3 gates only an answer that opens
<think>; a budget without reasoning tags is refused; every KV block is freed."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import assert_kv_all_free, hf_greedy
from tokenmill import LLM, SamplingParams, StructuredOutputsParams

START, END = [44, 17400, 46], [9617, 17400, 46]  # "<think>", "</think>" (SmolLM2's tokens)
PROMPTS = [[1, 504, 3120, 28], [17, 99, 1002, 4000, 8, 8, 8], [5] * 40]
CHOICES = ["alpha", "beta gamma", "delta"]


_REFERENCES: dict[tuple, list[int]] = {}  # (the tiny Llama is one model per session)


def hf_budgeted(model: torch.nn.Module, prompt: list[int], budget: int, max_tokens: int,
                reasoning: int = 0) -> list[int]:
    """HF greedy, with END appended once `budget` reasoning tokens (`reasoning` of them in
    the prompt) are written and END is not (the reference of a budget); computed once."""
    key = (id(model), tuple(prompt), budget, max_tokens, reasoning)
    if key not in _REFERENCES:
        _REFERENCES[key] = _hf_budgeted(model, prompt, budget, max_tokens, reasoning)
    return _REFERENCES[key]


@torch.no_grad()
def _hf_budgeted(model: torch.nn.Module, prompt: list[int], budget: int, max_tokens: int,
                 reasoning: int) -> list[int]:
    out: list[int] = []
    while len(out) < max_tokens:
        written = out[:len(out)]
        if END not in [written[i:i + 3] for i in range(len(written) - 2)] \
                and reasoning + len(out) >= budget:
            out += END[:max_tokens - len(out)]
            break
        out += hf_greedy(model, prompt + out, 1)
    while len(out) < max_tokens:
        out += hf_greedy(model, prompt + out, 1)
    return out[:max_tokens]


@pytest.fixture(scope="module")
def r1(tiny_model):
    folder, model = tiny_model("llama")
    llm = LLM(folder, max_model_len=512, num_kv_blocks=96, reasoning_parser="deepseek_r1")
    yield llm, model
    llm.engine.shutdown()


def greedy(llm, prompts, **fields) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, **fields), use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def test_a_budget_forces_the_end_where_hf_would_be_told_to(r1):
    llm, model = r1
    for budget in (0, 3, 6):
        (got,) = greedy(llm, PROMPTS[:1], max_tokens=14, thinking_token_budget=budget)
        assert got == hf_budgeted(model, PROMPTS[0], budget, 14), budget
        assert got[budget:budget + 3] == END
    assert_kv_all_free(llm.engine)


def test_budgets_in_one_batch_do_not_disturb_each_other(r1):
    llm, model = r1
    budgets = [2, None, 5]
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                        [SamplingParams(temperature=0, max_tokens=12, thinking_token_budget=b)
                         for b in budgets], use_tqdm=False)
    for prompt, budget, out in zip(PROMPTS, budgets, outs, strict=True):
        want = (hf_greedy(model, prompt, 12) if budget is None
                else hf_budgeted(model, prompt, budget, 12))
        assert list(out.outputs[0].token_ids) == want
    assert_kv_all_free(llm.engine)


def test_the_prompts_own_reasoning_counts(r1):
    llm, model = r1
    prompt = PROMPTS[0] + START + [504, 3120]
    (got,) = greedy(llm, [prompt], max_tokens=10, thinking_token_budget=4)
    assert got == hf_budgeted(model, prompt, 4, 10, reasoning=2)
    assert got[2:5] == END


def test_a_grammar_constrains_the_answer_after_the_reasoning(r1):
    llm, model = r1
    (got,) = greedy(llm, PROMPTS[:1], max_tokens=24, thinking_token_budget=4,
                    structured_outputs=StructuredOutputsParams(choice=CHOICES))
    assert got[:4] == hf_greedy(model, PROMPTS[0], 4) and got[4:7] == END
    answer = llm.get_tokenizer().decode(got[7:], skip_special_tokens=True)
    assert answer in CHOICES


def test_without_a_parser_the_budget_is_refused(tiny_model):
    llm = LLM(tiny_model("llama")[0], max_model_len=512, num_kv_blocks=32)
    with pytest.raises(ValueError, match="thinking_token_budget needs"):
        greedy(llm, PROMPTS[:1], max_tokens=4, thinking_token_budget=3)
    with pytest.raises(ValueError, match="thinking_token_budget must be"):
        SamplingParams(thinking_token_budget=-1)
    llm.engine.shutdown()


@pytest.mark.parametrize("jump_forward", [False, True])
def test_the_same_tokens_with_drafts_and_without_jump_forward(tiny_model, jump_forward):
    folder, model = tiny_model("llama")
    llm = LLM(folder, max_model_len=512, num_kv_blocks=96, reasoning_parser="deepseek_r1",
              structured_outputs_config={"jump_forward": jump_forward},
              speculative_config=None if jump_forward else
              {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2})
    (got,) = greedy(llm, PROMPTS[2:], max_tokens=12, thinking_token_budget=5)
    assert got == hf_budgeted(model, PROMPTS[2], 5, 12)
    assert_kv_all_free(llm.engine)
    llm.engine.shutdown()


def test_qwen3_gates_only_an_answer_that_opens_thinking(tiny_model):
    folder, model = tiny_model("llama")
    llm = LLM(folder, max_model_len=512, num_kv_blocks=96, reasoning_parser="qwen3",
              structured_outputs_config={"enable_in_reasoning": False})
    (free,) = greedy(llm, PROMPTS[:1], max_tokens=10, thinking_token_budget=2)
    assert free == hf_greedy(model, PROMPTS[0], 10)  # it never wrote <think>: all answer
    (choice,) = greedy(llm, PROMPTS[:1], max_tokens=10,
                       structured_outputs=StructuredOutputsParams(choice=CHOICES))
    assert llm.get_tokenizer().decode(choice, skip_special_tokens=True) in CHOICES
    opened = PROMPTS[0] + START
    (got,) = greedy(llm, [opened], max_tokens=10, thinking_token_budget=2)
    assert got == hf_budgeted(model, opened, 2, 10)
    llm.engine.shutdown()


def test_enable_in_reasoning_applies_the_grammar_from_the_first_token(tiny_model):
    llm = LLM(tiny_model("llama")[0], max_model_len=512, num_kv_blocks=32,
              reasoning_parser="deepseek_r1",
              structured_outputs_config={"enable_in_reasoning": True})
    (got,) = greedy(llm, PROMPTS[:1], max_tokens=10,
                    structured_outputs=StructuredOutputsParams(choice=CHOICES))
    assert llm.get_tokenizer().decode(got, skip_special_tokens=True) in CHOICES
    llm.engine.shutdown()


def test_under_async_scheduling_a_budget_keeps_its_step_ahead(tiny_model):
    """The same tokens as HF's reference, and nearly every step scheduled ahead of its
    sampled token, as without a budget: only the step that may spend it and the forced end
    wait (a grammar's request waits at every step)."""
    from tokenmill.engine.llm_engine import LLMEngine

    folder, model = tiny_model("llama")
    engine = LLMEngine.from_options(folder, max_model_len=512, num_kv_blocks=96,
                                    reasoning_parser="deepseek_r1", async_scheduling=True)
    assert engine.config.scheduler.async_scheduling

    def run(rid: str, params: SamplingParams) -> tuple[list[int], int]:
        """The request's tokens, and how many of its steps were fed a token in flight."""
        engine.add_request(rid, {"prompt_token_ids": PROMPTS[0]}, params)
        fed, tokens = engine.runner.num_fed_in_flight, []
        while engine.has_unfinished_requests():
            for out in engine.step():
                tokens = list(out.outputs[0].token_ids)
        return tokens, engine.runner.num_fed_in_flight - fed

    free, free_ahead = run("free", SamplingParams(temperature=0, max_tokens=24,
                                                  ignore_eos=True))
    got, budget_ahead = run("budget", SamplingParams(temperature=0, max_tokens=24,
                                                     ignore_eos=True, thinking_token_budget=8))
    assert free == hf_greedy(model, PROMPTS[0], 24)
    assert got == hf_budgeted(model, PROMPTS[0], 8, 24)
    assert free_ahead >= 20 and budget_ahead >= free_ahead - 5, (budget_ahead, free_ahead)
    _, regex_ahead = run("regex", SamplingParams(
        temperature=0, max_tokens=24, ignore_eos=True, thinking_token_budget=8,
        structured_outputs=StructuredOutputsParams(regex="[a-z ]{1,200}")))
    assert regex_ahead == 0
    engine.shutdown()


@pytest.mark.parametrize("options", [
    {"max_num_batched_tokens": 16},  # chunked prefill
    {"num_kv_blocks": 12, "block_size": 16},  # preemption (recompute) mid-reasoning
    {"async_scheduling": True, "num_kv_blocks": 12, "block_size": 16},
])
def test_budgets_under_engine_features(tiny_model, options):
    folder, model = tiny_model("llama")
    prompts = [PROMPTS[2] + [7] * 20, PROMPTS[1] * 6, PROMPTS[0] * 9]
    budgets = [6, 20, 33]
    llm = LLM(folder, max_model_len=512, reasoning_parser="deepseek_r1",
              **({"num_kv_blocks": 200} | options))
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        [SamplingParams(temperature=0, max_tokens=48, ignore_eos=True,
                                        thinking_token_budget=b) for b in budgets],
                        use_tqdm=False)
    for prompt, budget, out in zip(prompts, budgets, outs, strict=True):
        assert list(out.outputs[0].token_ids) == hf_budgeted(model, prompt, budget, 48)
    if options.get("num_kv_blocks") == 12:
        assert llm.engine.stats().num_preemptions > 0
    assert_kv_all_free(llm.engine)
    llm.engine.shutdown()
