"""Loading the tokenizer (and chat template) of a model folder or GGUF file with transformers.

A folder whose tokenizer_config.json names the generic fast tokenizer class (what
transformers writes for a tokenizer built from a GGUF file, so every converted GGUF folder) is
loaded with that class directly. `AutoTokenizer` would give the same object but first resolves
the model's config class, which imports the architecture's modules: about 2 s of a 6 s start.
Any other folder goes through `AutoTokenizer`, which knows model-specific tokenizer classes.
"""

from __future__ import annotations

import json
import os
from typing import Any

from tokenmill.config import ModelConfig

# tokenizer_class values that mean "tokenizer.json as it is" (transformers 5 and 4 names).
_GENERIC_FAST_CLASSES = frozenset({"TokenizersBackend", "PreTrainedTokenizerFast"})


def load_tokenizer(config: ModelConfig) -> Any:
    try:
        if config.tokenizer is not None:  # vLLM's --tokenizer: a folder (or a Hub id's)
            return _load_folder(config.tokenizer)
        if config.converted_dir is not None:
            return _load_folder(config.converted_dir)
        if config.gguf_file is not None:
            return gguf_tokenizer(config.gguf_file)
        return _load_folder(config.path)
    except Exception as e:  # transformers raises OSError, ValueError, KeyError, ...
        raise ValueError(f"cannot load a tokenizer for {config.path}: {e}") from e


def gguf_tokenizer(gguf_path: str) -> Any:
    """The tokenizer in a GGUF file's metadata. AutoTokenizer first parses the file's model
    config, which transformers refuses for architectures it has no GGUF config mapping for
    (OLMoE): those build the generic fast tokenizer from the same metadata directly."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    folder, name = os.path.split(gguf_path)
    try:
        return AutoTokenizer.from_pretrained(folder, gguf_file=name)
    except ValueError as e:
        if "is not supported yet" not in str(e):
            raise
        return PreTrainedTokenizerFast.from_pretrained(folder, gguf_file=name)


def _load_folder(folder: str) -> Any:
    if generic_fast_tokenizer(folder):
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(folder)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder)


def generic_fast_tokenizer(folder: str) -> bool:
    """Whether `folder` holds a tokenizer.json whose config asks for no model-specific class."""
    config_file = os.path.join(folder, "tokenizer_config.json")
    if not (os.path.isfile(config_file) and os.path.isfile(os.path.join(folder, "tokenizer.json"))):
        return False
    with open(config_file) as f:
        return json.load(f).get("tokenizer_class") in _GENERIC_FAST_CLASSES
