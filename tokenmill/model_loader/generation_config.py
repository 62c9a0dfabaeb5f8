"""The sampling defaults a model's creator recommends, from its generation_config.json, as
vLLM's --generation-config reads them: a request that leaves temperature, top_p, top_k,
min_p or a penalty unset takes the model's value (then vLLM's neutral one), and one that
leaves max_tokens unset stops at the model's max_new_tokens where it names one.

Sources: "auto" (the model folder's file, if it has one), "vllm" (none: vLLM's neutral
defaults), or a folder holding a generation_config.json. `override` (vLLM's
--override-generation-config) sets keys over the source's. Only the values a file sets
apart from transformers' defaults count (GenerationConfig.to_diff_dict), as in vLLM.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from tokenmill.utils.json_option import json_object

logger = logging.getLogger(__name__)

# what a generation config may set of a request's sampling (max_new_tokens: max_tokens)
SAMPLING_KEYS = ("repetition_penalty", "presence_penalty", "frequency_penalty", "temperature",
                 "top_k", "top_p", "min_p", "max_new_tokens")
_FILE = "generation_config.json"


def sampling_defaults(source: str, model_folder: str | None,
                      override: str | dict[str, Any] | None = None) -> dict[str, Any]:
    """The defaults as SamplingParams keywords (max_new_tokens as max_tokens); ValueError for
    a folder asked for without the file, an unknown override key or a value SamplingParams
    refuses (found at start-up, not by every request)."""
    if source == "vllm":
        config: dict[str, Any] = {}
    elif source == "auto":
        config = _diff_dict(model_folder) if _has_file(model_folder) else {}
    else:
        folder = os.path.expanduser(source)
        if not _has_file(folder):
            raise ValueError(f"generation_config: {folder} holds no {_FILE} (or pass 'auto' "
                             "for the model's own, 'vllm' for none)")
        config = _diff_dict(folder)
    config.update(_override(override))
    defaults = {k: config[k] for k in SAMPLING_KEYS if config.get(k) is not None}
    if "max_new_tokens" in defaults:
        defaults["max_tokens"] = defaults.pop("max_new_tokens")
    _check(defaults)
    return defaults


def model_sampling_defaults(model_path: str, source: str,
                            override: str | dict[str, Any] | None) -> dict[str, Any]:
    """sampling_defaults for the model at `model_path` (a folder; a .gguf file has none of
    its own), logged when they replace vLLM's neutral ones, as vLLM warns."""
    folder = model_path if os.path.isdir(model_path) else None
    defaults = sampling_defaults(source, folder, override)
    if defaults:
        logger.warning("default sampling parameters are %s's: %s (a request's own values "
                       "take precedence; --generation-config vllm for vLLM's neutral ones)",
                       "the model's generation_config.json" if source == "auto" else
                       "the override" if source == "vllm" else source, defaults)
    return defaults


def _has_file(folder: str | None) -> bool:
    return folder is not None and os.path.isfile(os.path.join(folder, _FILE))


def _diff_dict(folder: str) -> dict[str, Any]:
    from transformers import GenerationConfig

    return GenerationConfig.from_pretrained(folder).to_diff_dict()


def _override(override: str | dict[str, Any] | None) -> dict[str, Any]:
    if override is None:
        return {}
    override = json_object(override, "override_generation_config")
    unknown = sorted(set(override) - set(SAMPLING_KEYS))
    if unknown:
        raise ValueError(f"override_generation_config: unknown key {unknown[0]!r}; known: "
                         f"{', '.join(SAMPLING_KEYS)}")
    return override


def _check(defaults: dict[str, Any]) -> None:
    from tokenmill.sampling_params import SamplingParams

    try:
        SamplingParams(**defaults)
    except (TypeError, ValueError) as e:
        raise ValueError(f"the generation config's sampling defaults {defaults}: {e}") from e
