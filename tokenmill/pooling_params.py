"""Embeddings: how a prompt's final hidden states become one vector (vLLM's pooling names).

`PoolerConfig` is the engine's (vLLM's --pooler-config): `pooling_type` "LAST" (the last
token's hidden state: what decoder embedding models such as Qwen3-Embedding and e5-mistral
are trained for, and vLLM's default for them) or "MEAN" (the average over the prompt's
tokens), and `normalize` (L2, on by default). `PoolingParams` is a request's: it may turn
normalization off and ask for fewer `dimensions` (the first d features, then normalized:
OpenAI's truncation of Matryoshka embeddings). Every field is validated here; an invalid one
is a ValueError naming it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tokenmill.utils.json_option import json_object

POOLING_TYPES = ("LAST", "MEAN")


@dataclass(frozen=True)
class PoolerConfig:
    pooling_type: str = "LAST"
    normalize: bool = True

    def __post_init__(self) -> None:
        if self.pooling_type not in POOLING_TYPES:
            raise ValueError(f"pooling_type must be one of {', '.join(POOLING_TYPES)}, "
                             f"got {self.pooling_type!r}")
        if not isinstance(self.normalize, bool):
            raise ValueError(f"normalize must be true or false, got {self.normalize!r}")

    @staticmethod
    def parse(value: PoolerConfig | dict[str, Any] | str | None) -> PoolerConfig:
        """From a PoolerConfig, a dict or a JSON string (the CLI's); None: the defaults."""
        if value is None or isinstance(value, PoolerConfig):
            return value or PoolerConfig()
        value = json_object(value, "pooler_config")
        unknown = set(value) - {"pooling_type", "normalize"}
        if unknown:
            raise ValueError(f"pooler_config: unknown field(s) {', '.join(sorted(unknown))}; "
                             "known: pooling_type, normalize")
        kwargs = dict(value)
        if isinstance(kwargs.get("pooling_type"), str):
            kwargs["pooling_type"] = kwargs["pooling_type"].upper()
        return PoolerConfig(**kwargs)


@dataclass(frozen=True)
class PoolingParams:
    normalize: bool | None = None  # None: the engine's PoolerConfig.normalize
    dimensions: int | None = None  # None: all hidden_size features
    # resolved by the engine from its PoolerConfig (not a request's choice, as in vLLM)
    pooling_type: str | None = None

    def __post_init__(self) -> None:
        if self.normalize is not None and not isinstance(self.normalize, bool):
            raise ValueError(f"normalize must be true or false, got {self.normalize!r}")
        if self.dimensions is not None and (isinstance(self.dimensions, bool)
                                            or not isinstance(self.dimensions, int)
                                            or self.dimensions < 1):
            raise ValueError(f"dimensions must be a positive integer, got {self.dimensions!r}")

    def resolve(self, pooler: PoolerConfig, hidden_size: int) -> PoolingParams:
        """These parameters with the engine's defaults filled in; ValueError when `dimensions`
        exceeds the model's hidden size."""
        if self.dimensions is not None and self.dimensions > hidden_size:
            raise ValueError(f"dimensions ({self.dimensions}) exceeds the model's embedding "
                             f"size {hidden_size}")
        normalize = pooler.normalize if self.normalize is None else self.normalize
        return PoolingParams(normalize, self.dimensions, pooler.pooling_type)
