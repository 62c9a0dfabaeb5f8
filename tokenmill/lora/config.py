"""LoRAConfig: the limits of multi-LoRA serving (vLLM's --enable-lora and its companions)."""

from __future__ import annotations

from dataclasses import dataclass

LORA_DTYPES = ("auto", "float32", "bfloat16", "float16")


@dataclass(frozen=True)
class LoRAConfig:
    # adapters a step may use at once (each has a slot in every targeted layer)
    max_loras: int = 1
    # the largest rank an adapter may have (the slots' size)
    max_lora_rank: int = 16
    # adapters kept in memory, read from their folders, least recently used out (None:
    # max_loras); at least max_loras
    max_cpu_loras: int | None = None
    # the dtype adapter slots hold A and B in (vLLM's --lora-dtype), resolved from "auto" by
    # config_factory: the base weights' dtype (a bf16 checkpoint's on CPU; float32 for
    # quantized and float32 bases)
    lora_dtype: str = "auto"

    def __post_init__(self) -> None:
        for name in ("max_loras", "max_lora_rank"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_cpu_loras is None:
            object.__setattr__(self, "max_cpu_loras", self.max_loras)
        if self.lora_dtype not in LORA_DTYPES:
            raise ValueError(f"lora_dtype must be one of {', '.join(LORA_DTYPES)}, got "
                             f"{self.lora_dtype!r}")
        if self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras "
                             f"({self.max_loras})")
