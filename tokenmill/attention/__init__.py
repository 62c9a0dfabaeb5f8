"""Attention: typed per-step metadata, a backend interface with a registry, and the KV cache."""

from tokenmill.attention.base import AttentionBackend
from tokenmill.attention.metadata import AttentionMetadata
from tokenmill.attention.registry import get_attention_backend

__all__ = ["AttentionBackend", "AttentionMetadata", "get_attention_backend"]
