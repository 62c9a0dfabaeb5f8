"""Small helpers shared across packages."""

from tokenmill.utils.sizes import cdiv, parse_size

__all__ = ["cdiv", "parse_size"]
