"""Model definitions (nn.Modules that read like Hugging Face's) and the architecture registry."""

from tokenmill.models.registry import resolve_model_class

__all__ = ["resolve_model_class"]
