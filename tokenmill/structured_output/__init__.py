"""Structured outputs: constraining a request's tokens to a JSON schema, regex, choice or
grammar through a grammar library's token masks (params.py, backend.py, manager.py)."""

from tokenmill.structured_output.config import StructuredOutputsConfig
from tokenmill.structured_output.params import StructuredOutputsParams

__all__ = ["StructuredOutputsConfig", "StructuredOutputsParams"]
