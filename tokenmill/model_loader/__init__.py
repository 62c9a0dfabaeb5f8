"""Loading weights into models: streaming (name, tensor) iterators per format, and the loader."""

from tokenmill.model_loader.loader import load_model

__all__ = ["load_model"]
