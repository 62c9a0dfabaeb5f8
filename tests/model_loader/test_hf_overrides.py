"""vLLM's --hf-overrides: config values set over the checkpoint's, on a copy, seen by the
context length and the model (greedy equal to HF's model built with the same values)."""

from __future__ import annotations

import pytest
from transformers import AutoModelForCausalLM, LlamaConfig

from tests.conftest import hf_greedy
from tokenmill import LLM, SamplingParams
from tokenmill.engine_args import engine_config
from tokenmill.model_loader.hf_overrides import parse_hf_overrides, with_hf_overrides


def test_the_model_runs_with_the_overridden_values(tiny_model):
    path, _ = tiny_model("llama")
    overrides = {"rms_norm_eps": 0.05, "max_position_embeddings": 300}
    llm = LLM(path, hf_overrides=overrides, num_kv_blocks=64)
    assert llm.engine.config.model.max_model_len == 300
    hf = AutoModelForCausalLM.from_pretrained(path, rms_norm_eps=0.05).eval()
    prompt = [7, 100, 2000, 31, 5]
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0].token_ids
    assert out == hf_greedy(hf, prompt, 8)
    assert engine_config(path).model.hf_config.rms_norm_eps != 0.05  # the checkpoint's, kept


def test_sub_configs_update_and_the_original_is_untouched():
    config = LlamaConfig(rms_norm_eps=1e-5, rope_parameters={"rope_type": "default",
                                                             "rope_theta": 10000.0})
    config.text_config = LlamaConfig(hidden_size=64)  # a sub-config, as multimodal ones nest
    new = with_hf_overrides(config, {"text_config": {"hidden_size": 32}, "new_key": [1]})
    assert new.text_config.hidden_size == 32 and new.new_key == [1]
    assert config.text_config.hidden_size == 64 and not hasattr(config, "new_key")
    assert with_hf_overrides(config, {}) is config


@pytest.mark.parametrize("value", ['{"a": ', "[1, 2]", "3"])
def test_only_a_json_object_is_taken(value):
    with pytest.raises(ValueError, match="hf_overrides (is not valid JSON|must be a JSON "
                                         "object)"):
        parse_hf_overrides(value)
