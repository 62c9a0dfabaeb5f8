"""The weight-format specs benchmarks compare in one run (`--compare-quantization`,
quant_quality's `--methods`): "none", a quantization method ("int8", "gguf", ...), with
optional suffixes "+int8acts" (int8_activations=True) or "+rtn" (int4 without its
activation-aware search), and "/G" for int4's group size ("int4/64+rtn")."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any


@contextlib.contextmanager
def weights_as(spec: str) -> Iterator[dict[str, Any]]:
    """Engine options for `spec`; build the engine inside the block (int4's group and search
    are load-time settings, restored on exit). Unknown suffixes are a ValueError."""
    from tokenmill import quantization
    from tokenmill.quantization import load_time

    name, _, flag = spec.partition("+")
    method, _, group = name.partition("/")
    if flag not in ("", "int8acts", "rtn"):
        raise ValueError(f"unknown suffix +{flag} in {spec!r} (+int8acts, +rtn)")
    if (group or flag == "rtn") and method != "int4":
        raise ValueError(f"{spec!r}: '/G' and '+rtn' apply to int4 only")
    saved = load_time.INT4_GROUP, quantization.INT4_CALIBRATION
    load_time.INT4_GROUP = int(group) if group else saved[0]
    quantization.INT4_CALIBRATION = flag != "rtn"
    try:
        yield {"quantization": "none" if method in ("", "none") else method,
               "int8_activations": flag == "int8acts"}
    finally:
        load_time.INT4_GROUP, quantization.INT4_CALIBRATION = saved
