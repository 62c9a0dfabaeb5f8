"""vLLM's --hf-overrides: values set over the checkpoint's config.json (a JSON object), on a
copy: the model, its context length and everything read from the config see them, while the
object transformers loaded is left as it was. A key naming a sub-config (e.g. `text_config`)
with an object value updates that sub-config's keys, as vLLM does; any other key is set as
given (a new key included: architectures may read it).
"""

from __future__ import annotations

import copy
from typing import Any

from tokenmill.utils.json_option import json_object


def parse_hf_overrides(value: str | dict[str, Any] | None) -> dict[str, Any]:
    """The overrides as a dict; ValueError for anything but a JSON object."""
    return {} if value is None else json_object(value, "hf_overrides")


def with_hf_overrides(hf_config: Any, overrides: dict[str, Any]) -> Any:
    """`hf_config` itself without overrides, else a copy with them set."""
    if not overrides:
        return hf_config
    config = copy.deepcopy(hf_config)
    _apply(config, overrides)
    return config


def _apply(config: Any, overrides: dict[str, Any]) -> None:
    for key, value in overrides.items():
        current = getattr(config, key, None)
        if isinstance(value, dict) and hasattr(current, "to_dict"):  # a sub-config
            _apply(current, value)
        else:
            setattr(config, key, value)
