"""ReasoningConfig from --reasoning-parser and --reasoning-config: the parser's tags by
default, the forced end replaceable, both strings needed without a parser, bad values and
unknown keys refused by name."""

from __future__ import annotations

import pytest

from tokenmill.reasoning.config import ReasoningConfig


def test_the_parsers_tags_unless_told_otherwise():
    assert ReasoningConfig.parse(None, None) is None
    r1 = ReasoningConfig.parse("deepseek_r1", None)
    assert r1.tags == ("<think>", "</think>", "</think>") and r1.reasoning_without_tags
    phrase = ReasoningConfig.parse("qwen3", '{"reasoning_end_str": "Enough.</think>"}')
    assert phrase.tags == ("<think>", "</think>", "Enough.</think>")
    assert not phrase.reasoning_without_tags
    custom = ReasoningConfig.parse(None, {"reasoning_start_str": "[T]",
                                          "reasoning_end_str": "[/T]"})
    assert custom.tags == ("[T]", "[/T]", "[/T]") and not custom.reasoning_without_tags


@pytest.mark.parametrize("parser, config, words", [
    ("r2", None, "unknown reasoning parser"),
    (None, {"reasoning_end_str": "x"}, "both"),
    ("qwen3", {"reasoning_end": "x"}, "unknown field"),
    ("qwen3", {"reasoning_end_str": ""}, "non-empty"),
    ("qwen3", "[1]", "JSON object"),
])
def test_refused_by_name(parser, config, words):
    with pytest.raises(ValueError, match=words):
        ReasoningConfig.parse(parser, config)
