"""Integer helpers: ceiling division and human-readable byte sizes ("512MiB", "4GiB", "1.5GB")."""

from __future__ import annotations

import re

_UNITS = {
    "": 1, "b": 1,
    "k": 10**3, "kb": 10**3, "kib": 2**10,
    "m": 10**6, "mb": 10**6, "mib": 2**20,
    "g": 10**9, "gb": 10**9, "gib": 2**30,
    "t": 10**12, "tb": 10**12, "tib": 2**40,
}


def cdiv(a: int, b: int) -> int:
    """Ceiling of a / b for non-negative integers."""
    return -(-a // b)


def parse_size(value: int | float | str) -> int:
    """Bytes from an int or a string such as "512MiB", "4GiB", "1.5GB" or "1000000"."""
    if isinstance(value, bool):
        raise ValueError(f"invalid size {value!r}")
    if isinstance(value, int | float):
        n = int(value)
    else:
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(value))
        if not m or m.group(2).lower() not in _UNITS:
            raise ValueError(
                f"invalid size {value!r}: use bytes or a number with a unit "
                "such as 512MiB, 4GiB or 2GB"
            )
        n = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    if n <= 0:
        raise ValueError(f"size must be positive, got {value!r}")
    return n
