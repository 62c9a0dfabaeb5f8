"""A model's generation_config.json as the default sampling of requests that leave it unset
(vLLM's --generation-config auto | vllm | FOLDER and --override-generation-config): which
keys count, max_new_tokens as max_tokens, overrides, and every bad source refused at start."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tokenmill.model_loader.generation_config import sampling_defaults

RECOMMENDED = {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "min_p": 0.05,
               "repetition_penalty": 1.1, "presence_penalty": 0.2, "frequency_penalty": 0.1,
               "max_new_tokens": 7, "do_sample": True, "bos_token_id": 1, "eos_token_id": 2}


def _folder(tmp_path: Path, config: dict) -> str:
    (tmp_path / "generation_config.json").write_text(json.dumps(config))
    return str(tmp_path)


def test_the_model_s_recommended_values_become_the_defaults(tmp_path):
    folder = _folder(tmp_path, RECOMMENDED)
    assert sampling_defaults("auto", folder) == {
        "temperature": 0.6, "top_p": 0.9, "top_k": 20, "min_p": 0.05,
        "repetition_penalty": 1.1, "presence_penalty": 0.2, "frequency_penalty": 0.1,
        "max_tokens": 7}  # (special tokens and do_sample are not sampling defaults)
    assert sampling_defaults("vllm", folder) == {}
    assert sampling_defaults(folder, None) == sampling_defaults("auto", folder)


def test_neutral_values_change_nothing_and_missing_files_count_nothing(tmp_path):
    # (transformers 4 drops values equal to its defaults; 5's defaults are None, so they stay,
    # equal to vLLM's neutral ones)
    got = sampling_defaults("auto", _folder(tmp_path, {"temperature": 1.0, "top_p": 1.0,
                                                       "bos_token_id": 1}))
    assert set(got) <= {"temperature", "top_p"} and all(v == 1.0 for v in got.values())
    assert sampling_defaults("auto", str(tmp_path / "elsewhere")) == {}
    assert sampling_defaults("auto", None) == {}  # a GGUF file: none of its own


def test_overrides_win(tmp_path):
    folder = _folder(tmp_path, {"temperature": 0.6, "top_k": 20})
    assert sampling_defaults("auto", folder, '{"temperature": 0.2, "max_new_tokens": 3}') == {
        "temperature": 0.2, "top_k": 20, "max_tokens": 3}
    assert sampling_defaults("vllm", folder, {"top_p": 0.5}) == {"top_p": 0.5}


@pytest.mark.parametrize("source, override, match", [
    ("FOLDER/none", None, "holds no generation_config.json"),
    ("auto", '{"temperature": 0.2', "is not valid JSON"),
    ("auto", "[1]", "must be a JSON object"),
    ("auto", '{"seed": 3}', "unknown key 'seed'"),
    ("auto", '{"temperature": -1}', "temperature"),
    ("auto", '{"top_k": "many"}', "top_k"),
])
def test_bad_sources_are_refused(tmp_path, source, override, match):
    folder = _folder(tmp_path, {"top_k": 20})
    with pytest.raises(ValueError, match=match):
        sampling_defaults(source.replace("FOLDER", str(tmp_path)), folder, override)
