"""CUDA graphs' options, as vLLM users give them: `--enforce-eager`, `--cuda-graph-sizes` /
`--max-cudagraph-capture-size`, or the same in `--compilation-config` JSON
(`cudagraph_mode`, `cudagraph_capture_sizes`, `max_cudagraph_capture_size`).

tokenmill captures plain decode steps only (worker/cuda_graphs.py) and compiles nothing with
torch.compile; mixed prefill + decode steps run eagerly on fused kernels. So of vLLM's
`cudagraph_mode`s, NONE means no graphs, FULL_DECODE_ONLY is what runs, and
FULL_AND_PIECEWISE (vLLM's default) is taken as the default here too (its piecewise half:
eager steps); PIECEWISE and FULL, which graph the mixed steps, are refused, as is every
compilation key other than those three: nothing is ignored.
"""

from __future__ import annotations

from typing import Any

from tokenmill.utils.json_option import json_object

_MODES = {"NONE": True, "FULL_DECODE_ONLY": False, "FULL_AND_PIECEWISE": False}  # → eager
_KEYS = ("cudagraph_mode", "cudagraph_capture_sizes", "max_cudagraph_capture_size")


def resolve_graphs(enforce_eager: bool | None, sizes: int | list[int] | tuple[int, ...] | None,
                   compilation: str | dict[str, Any] | None
                   ) -> tuple[bool, tuple[int, ...] | None]:
    """(enforce_eager, the capture sizes asked or None); ValueError for what cannot run or
    is asked twice."""
    eager, sizes = bool(enforce_eager), _as_sizes(sizes)
    if compilation is None:
        return eager, sizes
    config = json_object(compilation, "compilation_config")
    unknown = [k for k in config if k not in _KEYS]
    if unknown:
        raise ValueError(f"compilation_config: {unknown[0]!r} is not supported by tokenmill "
                         f"(it compiles nothing; its keys: {', '.join(_KEYS)})")
    mode = config.get("cudagraph_mode")
    if mode is not None:
        if str(mode).upper() not in _MODES:
            raise ValueError(f"compilation_config: cudagraph_mode {mode!r} is not supported "
                             f"by tokenmill, which graphs decode steps only: "
                             f"{', '.join(_MODES)}")
        eager = eager or _MODES[str(mode).upper()]
    asked = [config[k] for k in _KEYS[1:] if k in config]
    if asked:
        if sizes is not None or len(asked) > 1:
            raise ValueError("the capture sizes are asked twice: give one of "
                             "--cuda-graph-sizes, cudagraph_capture_sizes and "
                             "max_cudagraph_capture_size")
        sizes = _as_sizes(asked[0])
    return eager, sizes


def _as_sizes(asked: int | list[int] | tuple[int, ...] | None) -> tuple[int, ...] | None:
    """Capture sizes as a tuple (an int, as vLLM's max_cudagraph_capture_size, is one value);
    EngineConfig checks the values."""
    if asked is None:
        return None
    return (asked,) if isinstance(asked, int) else tuple(asked)
