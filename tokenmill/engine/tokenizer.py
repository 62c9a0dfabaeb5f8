"""Loading the tokenizer (and chat template) of a model folder or GGUF file with transformers."""

from __future__ import annotations

import os
from typing import Any

from tokenmill.config import ModelConfig


def load_tokenizer(config: ModelConfig) -> Any:
    from transformers import AutoTokenizer

    try:
        if config.converted_dir is not None:
            return AutoTokenizer.from_pretrained(config.converted_dir)
        if config.gguf_file is not None:
            folder, name = os.path.split(config.gguf_file)
            return AutoTokenizer.from_pretrained(folder, gguf_file=name)
        return AutoTokenizer.from_pretrained(config.path)
    except Exception as e:  # transformers raises OSError, ValueError, KeyError, ...
        raise ValueError(f"cannot load a tokenizer for {config.path}: {e}") from e
