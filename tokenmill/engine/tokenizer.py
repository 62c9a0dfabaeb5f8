"""Loading the tokenizer (and chat template) of a model folder or GGUF file with transformers,
and a chat template asked for instead of the tokenizer's (vLLM's --chat-template).

A folder whose tokenizer_config.json names the generic fast tokenizer class (what
transformers writes for a tokenizer built from a GGUF file, so every converted GGUF folder) is
loaded with that class directly. `AutoTokenizer` would give the same object but first resolves
the model's config class, which imports the architecture's modules: about 2 s of a 6 s start.
Any other folder goes through `AutoTokenizer`, which knows model-specific tokenizer classes.
"""

from __future__ import annotations

import codecs
import json
import os
from typing import Any

from tokenmill.config import ModelConfig

# tokenizer_class values that mean "tokenizer.json as it is" (transformers 5 and 4 names).
_GENERIC_FAST_CLASSES = frozenset({"TokenizersBackend", "PreTrainedTokenizerFast"})


def load_tokenizer(config: ModelConfig) -> Any:
    try:
        trust = config.trust_remote_code
        if config.tokenizer is not None:  # vLLM's --tokenizer: a folder (or a Hub id's)
            return _load_folder(config.tokenizer, trust)
        if config.converted_dir is not None:
            return _load_folder(config.converted_dir, trust)
        if config.gguf_file is not None:
            return gguf_tokenizer(config.gguf_file, config.hf_config.model_type)
        return _load_folder(config.path, trust)
    except Exception as e:  # transformers raises OSError, ValueError, KeyError, ...
        raise ValueError(f"cannot load a tokenizer for {config.path}: {e}") from e


def gguf_tokenizer(gguf_path: str, model_type: str | None = None) -> Any:
    """The tokenizer in a GGUF file's metadata, of the class AutoTokenizer would pick.

    With the model's `model_type` (tokenmill has already parsed the file), the class comes
    from transformers' table by that type, as AutoTokenizer picks it for a GGUF file with no
    tokenizer_config.json beside it, and the class reads the vocabulary itself. AutoTokenizer
    would first parse the file's whole metadata again to find the model type (with the gguf
    package's per-element reader for most architectures: ~6 s for SmolLM2's 49k-token
    vocabulary, more for Llama 3's 128k). Without a type, or beside a tokenizer_config.json
    (which could name another class), AutoTokenizer decides; it refuses to parse the config
    of architectures it has no GGUF mapping for (OLMoE): those get the generic fast tokenizer
    from the same metadata."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    folder, name = os.path.split(gguf_path)
    direct = _gguf_tokenizer_class(model_type, folder)
    if direct is not None:
        return direct.from_pretrained(folder, gguf_file=name)
    try:
        return AutoTokenizer.from_pretrained(folder, gguf_file=name)
    except ValueError as e:
        if "is not supported yet" not in str(e):
            raise
        return PreTrainedTokenizerFast.from_pretrained(folder, gguf_file=name)


def _gguf_tokenizer_class(model_type: str | None, folder: str) -> Any | None:
    """The class AutoTokenizer gives a GGUF file of `model_type` alone in `folder` (its table
    entry, else the generic fast tokenizer); None where AutoTokenizer must decide."""
    from transformers import PreTrainedTokenizerFast
    from transformers.models.auto.tokenization_auto import (
        TOKENIZER_MAPPING_NAMES,
        tokenizer_class_from_name,
    )

    if model_type is None or os.path.isfile(os.path.join(folder, "tokenizer_config.json")):
        return None
    name = TOKENIZER_MAPPING_NAMES.get(model_type)
    if name is None:
        return PreTrainedTokenizerFast  # transformers 5: TokenizersBackend under this name
    if name.startswith("MistralCommon"):  # AutoTokenizer checks the files for this one
        return None
    return tokenizer_class_from_name(name)


def _load_folder(folder: str, trust_remote_code: bool = False) -> Any:
    if generic_fast_tokenizer(folder):
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(folder)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder, trust_remote_code=trust_remote_code)


def generic_fast_tokenizer(folder: str) -> bool:
    """Whether `folder` holds a tokenizer.json whose config asks for no model-specific class."""
    config_file = os.path.join(folder, "tokenizer_config.json")
    if not (os.path.isfile(config_file) and os.path.isfile(os.path.join(folder, "tokenizer.json"))):
        return False
    with open(config_file) as f:
        return json.load(f).get("tokenizer_class") in _GENERIC_FAST_CLASSES


_JINJA_CHARS = "{}\n"


def load_chat_template(value: str | None) -> str | None:
    """vLLM's --chat-template: a file's text, or the template itself when `value` is not a
    readable file and holds Jinja's characters (escapes such as \\n decoded); ValueError for
    what looks like a path but cannot be read."""
    if value is None:
        return None
    try:
        with open(os.path.expanduser(value), encoding="utf-8") as f:
            return f.read()
    except OSError as e:
        if any(c in value for c in _JINJA_CHARS):
            return codecs.decode(value, "unicode_escape")
        raise ValueError(f"chat_template {value!r} looks like a file path, but it cannot be "
                         f"read: {e}") from e


def chat_template_of(config: ModelConfig, tokenizer: Any) -> str | None:
    """The chat template conversations are rendered with: the one asked for
    (ModelConfig.chat_template), else the tokenizer's own; None: the model has none."""
    return config.chat_template or getattr(tokenizer, "chat_template", None)
