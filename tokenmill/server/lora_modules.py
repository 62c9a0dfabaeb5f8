"""The LoRA adapters a server serves by name: vLLM's `--lora-modules` and its runtime routes.

A request whose `model` names an adapter runs with it; `/v1/models` lists each adapter with the
served model as its `parent`. With `VLLM_ALLOW_RUNTIME_LORA_UPDATING=True` in the environment
(vLLM's switch), `POST /v1/load_lora_adapter {"lora_name", "lora_path"}` checks and adds one
and `POST /v1/unload_lora_adapter {"lora_name"}` removes one; requests already running with it
finish with it. An adapter is checked when it is added (at start-up or by the route), through
the engine's own registry (lora/registry.py): a bad one is refused by name and the server
serves on.
"""

from __future__ import annotations

import itertools
import json
import os
import threading
from collections.abc import Callable, Sequence

from tokenmill.lora.request import AdapterRef, LoRARequest

RUNTIME_UPDATES_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"


class UnknownModel(Exception):
    """A request named a model or adapter the server does not serve (404, OpenAI's shape)."""


def runtime_updates_allowed() -> bool:
    return os.environ.get(RUNTIME_UPDATES_ENV, "").strip().lower() in ("1", "true")


def parse_lora_modules(specs: list[str]) -> list[LoRARequest]:
    """--lora-modules entries: `name=path` or vLLM's JSON form
    `{"name": ..., "path": ..., "base_model_name": ...}`; ids 1, 2, ... in order."""
    out: list[LoRARequest] = []
    for i, spec in enumerate(specs, start=1):
        if spec.lstrip().startswith("{"):
            try:
                entry = json.loads(spec)
                name, path = entry["name"], entry["path"]
            except (ValueError, KeyError, TypeError) as e:
                raise ValueError(f"--lora-modules: {spec!r} is not name=path or JSON with "
                                 f"'name' and 'path' ({e})") from None
            out.append(LoRARequest(name, i, path, entry.get("base_model_name")))
            continue
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--lora-modules: {spec!r} is not name=path")
        out.append(LoRARequest(name, i, path))
    return out


class ServedAdapters:
    def __init__(self, base_names: str | Sequence[str],
                 check: Callable[[LoRARequest], AdapterRef | None], enabled: bool) -> None:
        """base_names: the served model's names (the first is its name in answers);
        check: the engine's validation of an adapter (ValueError naming what is wrong)."""
        self.base_names = ((base_names,) if isinstance(base_names, str)
                           else tuple(base_names))
        self.base_name, self.check, self.enabled = self.base_names[0], check, enabled
        self._by_name: dict[str, LoRARequest] = {}
        self._ids = itertools.count(1)
        self._lock = threading.Lock()

    def add(self, lora: LoRARequest) -> LoRARequest:
        """Check and serve an adapter under its name (a new int id); ValueError if it cannot
        be served or the name is taken."""
        if not self.enabled:
            raise ValueError("this server serves no LoRA adapters; start it with --enable-lora")
        if lora.lora_name in self.base_names or lora.lora_name in self._by_name:
            raise ValueError(f"the name {lora.lora_name!r} is already served")
        if lora.base_model_name not in (None, *self.base_names):
            raise ValueError(f"LoRA adapter {lora.lora_name!r} is for base model "
                             f"{lora.base_model_name!r}; this server serves {self.base_name!r}")
        self.check(lora)
        with self._lock:
            lora = LoRARequest(lora.lora_name, next(self._ids), lora.lora_path,
                               lora.base_model_name)
            self._by_name[lora.lora_name] = lora
        return lora

    def remove(self, name: str) -> None:
        with self._lock:
            if self._by_name.pop(name, None) is None:
                raise UnknownModel(f"The LoRA adapter `{name}` is not loaded.")

    def resolve(self, name: str | None) -> LoRARequest | None:
        """The adapter a request's `model` names (None: the served model itself)."""
        if name is None or name in self.base_names:
            return None
        lora = self._by_name.get(name)
        if lora is None:
            raise UnknownModel(f"The model `{name}` does not exist.")
        return lora

    def all(self) -> list[LoRARequest]:
        return list(self._by_name.values())
