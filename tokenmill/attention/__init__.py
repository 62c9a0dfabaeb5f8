"""Attention: typed per-step metadata, a backend interface with a registry, and the KV cache."""

from tokenmill.attention.base import AttentionBackend, get_attention_backend
from tokenmill.attention.metadata import AttentionMetadata

__all__ = ["AttentionBackend", "AttentionMetadata", "get_attention_backend"]
