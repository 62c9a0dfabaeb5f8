"""The reasoning parsers' split (vLLM's deepseek_r1 and qwen3): whole answers, and answers
growing character by character, whose parts only ever grow and never show a piece of a tag."""

from __future__ import annotations

import pytest

from tokenmill.reasoning.parsers import END, get_reasoning_parser

CASES = [  # text, the prompt opened <think>, deepseek_r1's split, qwen3's split
    ("<think>\nLet me see.\n</think>\n\nParis.", False, ("\nLet me see.\n", "\n\nParis."),
     ("\nLet me see.\n", "\n\nParis.")),
    ("Let me see.</think>Paris.", True, ("Let me see.", "Paris."), ("Let me see.", "Paris.")),
    # no tags: R1 reasons, Qwen3 answers (a closing tag alone is text to it then)
    ("Paris.", False, ("Paris.", ""), (None, "Paris.")),
    ("Hmm.</think>Paris.", False, ("Hmm.", "Paris."), (None, "Hmm.</think>Paris.")),
    ("<think>cut by max_tokens", False, ("cut by max_tokens", ""), ("cut by max_tokens", "")),
    ("a < b </ c", True, ("a < b </ c", ""), ("a < b </ c", "")),
]


@pytest.mark.parametrize("text, opened, r1, qwen3", CASES)
def test_whole_answers(text, opened, r1, qwen3):
    assert get_reasoning_parser("deepseek_r1").split(text, True, opened) == r1
    assert get_reasoning_parser("qwen3").split(text, True, opened) == qwen3


@pytest.mark.parametrize("name", ["deepseek_r1", "qwen3"])
@pytest.mark.parametrize("text, opened", [c[:2] for c in CASES])
def test_growing_answers_only_grow_and_hide_partial_tags(name, text, opened):
    parser = get_reasoning_parser(name)
    shown_reasoning, shown_content = "", ""
    for end in range(len(text) + 1):
        finished = end == len(text)
        reasoning, content = parser.split(text[:end], finished, opened)
        reasoning = reasoning or ""
        assert reasoning.startswith(shown_reasoning) and content.startswith(shown_content)
        shown_reasoning, shown_content = reasoning, content
        if not finished:  # no piece of a tag at the end of the reasoning, or at the start
            assert not any(reasoning.endswith(END[:k]) for k in range(2, len(END) + 1))
            assert not content.startswith("<")
    whole = parser.split(text, True, opened)
    assert (shown_reasoning, shown_content) == (whole[0] or "", whole[1])


def test_a_prompt_opens_thinking_when_its_last_tag_opens():
    qwen3 = get_reasoning_parser("qwen3")
    assert qwen3.prompt_opens("<|im_start|>assistant\n<think>\n")
    assert not qwen3.prompt_opens("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not qwen3.prompt_opens("<|im_start|>assistant\n")
    mistral = get_reasoning_parser("mistral")
    assert mistral.prompt_opens("[INST]hi[/INST][THINK]") and not qwen3.prompt_opens("[THINK]")


def test_mistral_splits_at_its_own_tags():
    mistral = get_reasoning_parser("mistral")
    assert mistral.split("[THINK]Hmm.[/THINK]Paris.", True) == ("Hmm.", "Paris.")
    assert mistral.split("Paris.", True) == (None, "Paris.")
    assert mistral.split("Hmm.[/TH", False, opened=True) == ("Hmm.", "")



def test_unknown_parsers_are_named():
    with pytest.raises(ValueError, match="unknown reasoning parser 'r2'; known: deepseek_r1, "
                                         "mistral, qwen3"):
        get_reasoning_parser("r2")
