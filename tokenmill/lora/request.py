"""LoRARequest (vLLM's, by the same module path) and AdapterRef, what the engine resolves it to.

A user names an adapter with a LoRARequest: a name, an integer id and a peft folder. Names and
ids are the user's and get reused (the same id for another adapter after a restart, two names
for one folder), so the engine never keys anything on them: the front-end reads the folder once
and gives the request an `AdapterRef` whose `key` is a hash of the adapter's config and weights.
The scheduler counts distinct keys against `max_loras`, the prefix cache files blocks under the
key, and the runner loads by path and slots by key. Neither class imports torch: core/ holds
AdapterRefs.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """An adapter for a request: `LoRARequest(lora_name, lora_int_id, lora_path)` as in vLLM
    (`lora_int_id` >= 1; `base_model_name` is checked against the served model when set)."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be an integer >= 1, got {self.lora_int_id!r}")
        if not self.lora_name:
            raise ValueError("lora_name must not be empty")
        if not self.lora_path:
            raise ValueError(f"LoRA adapter {self.lora_name!r}: lora_path is required")

    # vLLM's accessors
    @property
    def adapter_id(self) -> int:
        return self.lora_int_id

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def path(self) -> str:
        return self.lora_path


@dataclass(frozen=True)
class AdapterRef:
    """A validated adapter as the engine carries it with a request: where to load it from and
    its identity (`key`: sha256 of its config and weights, hex)."""

    name: str
    int_id: int
    path: str
    key: str
    rank: int

    @property
    def short_key(self) -> str:
        return self.key[:12]
