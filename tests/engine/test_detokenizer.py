"""Incremental detokenization and stop strings with SmolLM2's byte-level tokenizer, where one
character can span several tokens (😀 is 2 tokens, 日 is 3)."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from tokenmill.core.interface import ModelRunnerOutput
from tokenmill.core.request import Request
from tokenmill.engine.detokenizer import IncrementalDetokenizer
from tokenmill.engine.output_processor import OutputProcessor
from tokenmill.sampling_params import SamplingParams

TEXT = "Hi 😀 日本 and more: ünïcödé ok."


@pytest.fixture(scope="module")
def tok(tokenizer_dir):
    return AutoTokenizer.from_pretrained(tokenizer_dir)


def test_incremental_text_never_holds_half_a_character(tok):
    ids = tok.encode(TEXT)
    assert len(ids) > len(TEXT.split())  # characters really are split over tokens
    detok = IncrementalDetokenizer(tok, tok.encode("Say:"), skip_special_tokens=True)
    deltas = [detok.add_tokens([t]) for t in ids]
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == detok.text == TEXT
    assert "" in deltas  # some tokens completed no character on their own


def run_processor(tok, params: SamplingParams, text: str = TEXT):
    """Feed `text`'s tokens one step at a time through the real OutputProcessor."""
    proc = OutputProcessor(tok)
    req = Request("r", tok.encode("Say:"), params, [2], max_tokens=100)
    proc.add("r", "Say:", req.prompt_token_ids, [req])
    outs, stopped_at = [], None
    for i, t in enumerate(tok.encode(text)):
        req.append_output_token(t)
        out, stopped = proc.process([req], ModelRunnerOutput(["r"], [[t]]))
        outs.append(out[0])
        if stopped:
            stopped_at = i
            break
    return outs, stopped_at


def test_stop_string_across_tokens(tok):
    outs, stopped_at = run_processor(tok, SamplingParams(stop=["本 an"]))
    final = outs[-1].outputs[0]
    assert stopped_at is not None and final.finish_reason == "stop"
    assert final.stop_reason == "本 an" and final.text == "Hi 😀 日"
    # while running, text never showed a prefix of the stop string nor half a character
    for o in outs[:-1]:
        assert "\ufffd" not in o.outputs[0].text and "本" not in o.outputs[0].text


def test_stop_string_included_and_multibyte_stop(tok):
    outs, _ = run_processor(tok, SamplingParams(stop=["日本"], include_stop_str_in_output=True))
    assert outs[-1].outputs[0].text == "Hi 😀 日本"
    outs, _ = run_processor(tok, SamplingParams(stop=["zzz", "😀"]))
    assert outs[-1].outputs[0].text == "Hi " and outs[-1].outputs[0].stop_reason == "😀"


def test_stop_string_respects_min_tokens(tok):
    n_before = len(tok.encode("Hi 😀"))
    outs, _ = run_processor(tok, SamplingParams(stop=["Hi"], min_tokens=n_before + 1))
    # "Hi" appears in the first tokens, before min_tokens: no stop there; no later "Hi" either
    assert outs[-1].outputs[0].finish_reason is None
    assert outs[-1].outputs[0].text.startswith("Hi 😀 日本")


class _WindowOnly:
    """The tokenizer without its Rust backend: the detokenizer's window path."""

    def __init__(self, tok) -> None:
        self.tok = tok

    def decode(self, ids, **kwargs):
        return self.tok.decode(ids, **kwargs)


@pytest.mark.parametrize("path", ["stream", "window"])
@pytest.mark.parametrize("prompt", ["Say:", "Say 日", "😀 and " + "日本" * 9, ""])
def test_text_is_the_outputs_decoded_whatever_the_prompt_ends_with(tok, path, prompt):
    """DecodeStream (fast tokenizers) and the decoded window (others) give the outputs' own
    text token by token, with or without special tokens, for every cut of the prompt: one
    mid-character too (its bytes are not the output's)."""
    ids = tok.encode(TEXT + "<|im_end|> and on")
    prompt_ids = tok.encode(prompt)
    cuts = range(len(prompt_ids) + 1) if path == "stream" else [len(prompt_ids)]
    for cut in cuts:
        for skip in (True, False):
            detok = IncrementalDetokenizer(tok if path == "stream" else _WindowOnly(tok),
                                           prompt_ids[:cut], skip_special_tokens=skip)
            assert (detok._rust is None) == (path == "window")
            deltas = [detok.add_tokens([t]) for t in ids]
            assert "".join(deltas) == detok.text == tok.decode(ids, skip_special_tokens=skip)
            assert all("\ufffd" not in d for d in deltas)
