"""The reasoning gate (reasoning/gate.py) token by token: a thinking budget forces the end of
thinking after so many reasoning tokens (the prompt's own counted, the part of the end the
model wrote kept), a natural end opens the answer, a grammar applies only to the answer, an
answer that does not open with the start tag is answer from its first token (qwen3), and
rollback restores every state exactly (drafts)."""

from __future__ import annotations

import pytest
import torch

from tokenmill.reasoning.config import ReasoningConfig
from tokenmill.reasoning.gate import (
    ANSWER,
    FORCING,
    THINKING,
    UNDECIDED,
    ReasoningGrammar,
    ReasoningTokens,
)
from tokenmill.structured_output import StructuredOutputsConfig, StructuredOutputsParams
from tokenmill.structured_output.backend import bitmask_width
from tokenmill.structured_output.manager import StructuredOutputManager

V = 49152
START, END = (44, 17400, 46), (9617, 17400, 46)  # SmolLM2's "<think>", "</think>"
R1 = ReasoningTokens(START, END, END, without_tags=True)
QWEN3 = ReasoningTokens(START, END, END, without_tags=False)


def allowed(matcher) -> set[int] | str:
    """The tokens the matcher's mask allows ("all" for an unconstrained row)."""
    m = torch.zeros(1, bitmask_width(V), dtype=torch.int32)
    matcher.fill_bitmask(m, 0)
    if bool((m == -1).all()):
        return "all"
    bits = [(int(w) >> b) & 1 for w in m[0] for b in range(32)]
    return {i for i, bit in enumerate(bits) if bit}


def feed(matcher, tokens) -> None:
    for t in tokens:
        assert matcher.accept(t), t


@pytest.fixture(scope="module")
def choice(smollm2_path):
    """A compiled choice grammar ("yes" / "no") and the tokenizer."""
    from tokenmill.config_model import model_config
    from tokenmill.engine.tokenizer import load_tokenizer

    tok = load_tokenizer(model_config(smollm2_path))
    manager = StructuredOutputManager(StructuredOutputsConfig(), tok, V, [2])
    return manager.compile(StructuredOutputsParams(choice=["yes", "no"])), tok


def test_the_tags_come_from_the_tokenizer(choice):
    _, tok = choice
    tokens = ReasoningTokens.of(ReasoningConfig("deepseek_r1"), tok)
    assert (tokens.start, tokens.end, tokens.forced_end) == (START, END, END)
    assert tokens.without_tags
    phrase = ReasoningTokens.of(ReasoningConfig(
        "qwen3", end_str="Time to answer.</think>"), tok)
    assert phrase.end == END and phrase.forced_end[-3:] == END and len(phrase.forced_end) > 3
    assert not phrase.without_tags


def test_where_the_prompt_leaves_off():
    assert R1.prompt_reasoning([1, 2, *START]) == 0
    assert R1.prompt_reasoning([1, *START, 7, 8]) == 2
    assert R1.prompt_reasoning([1, *START, 7, *END, 9]) is None
    assert R1.prompt_reasoning([1, 2, 3]) is None


def test_nothing_is_gated_without_a_budget_or_grammar():
    assert R1.gate(None, None, [1, 2]) is None
    grammar = ReasoningGrammar(R1, None, 3, THINKING, 0)  # any CompiledGrammar
    in_reasoning = ReasoningTokens(START, END, END, True, grammar_in_reasoning=True)
    assert in_reasoning.gate(grammar, None, [1]) is grammar
    assert isinstance(in_reasoning.gate(None, 3, [1]), ReasoningGrammar)
    with pytest.raises(ValueError, match="enable_in_reasoning"):
        in_reasoning.gate(grammar, 3, [1])  # a grammar from token 0 and a budget: refused
    assert isinstance(R1.gate(grammar, None, [1]), ReasoningGrammar)


def test_a_spent_budget_forces_the_end_then_frees_the_answer():
    m = R1.gate(None, 3, [1, *START]).matcher()
    feed(m, [5, 6])
    assert allowed(m) == "all" and m.forced_tokens() == []
    feed(m, [7])  # the third reasoning token: the budget is spent
    assert m.phase == FORCING and allowed(m) == {END[0]} and m.forced_tokens() == list(END)
    assert not m.accept(8)  # anything else is refused
    feed(m, END)
    assert m.phase == ANSWER and allowed(m) == "all"


def test_the_prompts_reasoning_counts_and_a_zero_budget_forces_at_once():
    m = R1.gate(None, 3, [1, *START, 5, 6]).matcher()
    feed(m, [7])
    assert m.phase == FORCING
    assert R1.gate(None, 0, [1]).matcher().phase == FORCING  # r1: reasoning from token 0


def test_the_end_the_model_began_is_finished_not_repeated():
    m = R1.gate(None, 4, [1]).matcher()
    feed(m, [5, 6, END[0], END[1]])  # budget spent just as it was closing
    assert m.phase == FORCING and m.forced_tokens() == [END[2]]
    feed(m, [END[2]])
    assert m.phase == ANSWER


def test_a_natural_end_before_the_budget_opens_the_answer():
    m = R1.gate(None, 10, [1]).matcher()
    feed(m, [5, *END, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9])
    assert m.phase == ANSWER and allowed(m) == "all"


def test_the_grammar_applies_to_the_answer_only(choice):
    grammar, tok = choice
    fresh = allowed(grammar.matcher())
    m = R1.gate(grammar, None, [1]).matcher()  # r1 reasons first, no budget
    assert allowed(m) == "all"
    feed(m, tok.encode(" any thought at all", add_special_tokens=False))
    feed(m, END)
    assert allowed(m) == fresh
    assert m.validate(tok.encode(" maybe", add_special_tokens=False)) == 0
    assert not m.accept(tok.encode(" maybe", add_special_tokens=False)[0])
    assert m.phase == ANSWER and allowed(m) == fresh  # a refused token changes nothing
    feed(m, tok.encode("yes", add_special_tokens=False))
    assert allowed(m) == {2} and m.is_terminated()  # complete: only EOS may follow


def test_an_answer_that_does_not_open_thinking_is_answer_at_once(choice):
    grammar, tok = choice
    fresh = allowed(grammar.matcher())
    m = QWEN3.gate(grammar, 5, [1, 2]).matcher()
    assert m.phase == UNDECIDED and allowed(m) == fresh | {START[0]}
    feed(m, [START[0]])  # may still open <think>: the grammar saw nothing
    assert allowed(m) == {START[1]}  # "<" is no prefix of yes / no either
    n = tok.encode("no", add_special_tokens=False)
    m2 = QWEN3.gate(grammar, 5, [1, 2]).matcher()
    feed(m2, n)
    assert m2.phase == ANSWER and allowed(m2) == {2}
    m3 = QWEN3.gate(None, 2, [1]).matcher()
    feed(m3, [*START, 5])
    assert m3.phase == THINKING
    feed(m3, [6])
    assert m3.phase == FORCING


def test_rollback_and_validate_restore_every_state(choice):
    grammar, tok = choice
    tokens = [*START, 5, 6, *END, *tok.encode("yes", add_special_tokens=False)]
    m = QWEN3.gate(grammar, 4, [1]).matcher()
    states = []
    for t in tokens:
        states.append((m.phase, m.count, m.recent, m.forced, allowed(m)))
        feed(m, [t])
    for i in range(len(tokens) - 1, -1, -1):
        m.rollback(1)
        assert (m.phase, m.count, m.recent, m.forced, allowed(m)) == states[i]
    assert m.validate(tokens) == len(tokens) and m.phase == UNDECIDED
    assert m.validate([*tokens, 2]) == len(tokens)  # complete: the request stops there
    forced = QWEN3.gate(None, 1, [1]).matcher()
    assert forced.validate([*START, 5, 6, 7]) == len(START) + 1  # 6 is not the forced end
    assert forced.phase == UNDECIDED and forced.validate([*START, 5, *END, 9]) == 8


def test_reasoning_tokens_are_counted_through_the_end_tag():
    assert R1.count([1], [5, 6, *END, 9, 9]) == 5  # r1: from the first token
    assert R1.count([1], [5, 6, 7]) == 3  # still reasoning
    assert QWEN3.count([1], [5, *END, 9]) == 0  # qwen3: it never opened
    assert QWEN3.count([1], [*START, 5, *END, 9]) == 7
    assert QWEN3.count([1, *START], [5, *END, 9]) == 4  # the prompt opened it


def test_a_budget_alone_is_decided_a_step_ahead_until_it_may_be_spent(choice):
    m = R1.gate(None, 3, [1]).matcher()
    assert m.decided_ahead()  # count 0: one more token makes 1 < 3
    feed(m, [5])
    assert m.decided_ahead()
    feed(m, [6])
    assert not m.decided_ahead()  # one more token makes 3: the end forced unless it ends
    feed(m, [7])
    assert m.phase == FORCING and not m.decided_ahead()
    feed(m, END)
    assert m.phase == ANSWER and m.decided_ahead()
    q = QWEN3.gate(None, 1, [1]).matcher()
    assert q.phase == UNDECIDED and q.decided_ahead()
    assert not QWEN3.gate(None, 0, [1]).matcher().decided_ahead()  # <think> would force
    grammar, _ = choice
    assert not R1.gate(grammar, 50, [1]).matcher().decided_ahead()  # a grammar: never


def test_only_the_forced_end_and_a_grammars_answer_take_a_mask(choice, smollm2_path):
    from tokenmill.core.interface import RequestStep, SchedulerOutput

    grammar, tok = choice
    m = R1.gate(None, 2, [1]).matcher()
    assert not m.constrains()  # thinking: free
    feed(m, [5, 6])
    assert m.constrains()  # forcing
    feed(m, END)
    assert not m.constrains()  # an answer without a grammar: free
    g = QWEN3.gate(grammar, None, [1]).matcher()
    assert g.constrains()  # undecided, with a grammar: the grammar or <think>
    feed(g, START)
    assert not g.constrains()
    manager = StructuredOutputManager(StructuredOutputsConfig(), tok, V, [2])
    step = SchedulerOutput(scheduled=[RequestStep(req_id="a", start_pos=3, num_new_tokens=1,
                                                  sample=True)])
    assert manager.submit(step, {"a": R1.gate(None, 9, [1]).matcher()}) is None  # no mask
    masks = manager.submit(step, {"a": m.__class__(R1, None, 0, THINKING, 0)}).masks()
    assert set(masks) == {"a"}  # a zero budget: the end forced at once
