"""CUDA graphs' options as vLLM users give them (config_graphs.py): --enforce-eager,
--cuda-graph-sizes, and --compilation-config's graph keys; every other compilation key, a
mode that graphs mixed steps, or sizes asked twice, refused by name."""

from __future__ import annotations

import pytest

from tokenmill.config_graphs import resolve_graphs


@pytest.mark.parametrize("eager, sizes, compilation, want", [
    (None, None, None, (False, None)),
    (True, None, None, (True, None)),
    (None, 64, None, (False, (64,))),
    (None, [1, 2], None, (False, (1, 2))),
    (None, None, '{"cudagraph_mode": "NONE"}', (True, None)),
    (None, None, {"cudagraph_mode": "full_decode_only"}, (False, None)),
    (None, None, {"cudagraph_mode": "FULL_AND_PIECEWISE"}, (False, None)),  # vLLM's default
    (True, None, {"cudagraph_mode": "FULL_DECODE_ONLY"}, (True, None)),  # eager wins
    (None, None, {"cudagraph_capture_sizes": [1, 8, 32]}, (False, (1, 8, 32))),
    (None, None, {"max_cudagraph_capture_size": 128}, (False, (128,))),
])
def test_what_each_spelling_asks(eager, sizes, compilation, want):
    assert resolve_graphs(eager, sizes, compilation) == want


@pytest.mark.parametrize("sizes, compilation, match", [
    (None, {"cudagraph_mode": "PIECEWISE"}, "cudagraph_mode 'PIECEWISE' is not supported"),
    (None, {"cudagraph_mode": "FULL"}, "graphs decode steps only"),
    (None, {"level": 3}, "'level' is not supported by tokenmill"),
    (None, {"use_inductor": True}, "compiles nothing"),
    ([1, 2], {"cudagraph_capture_sizes": [4]}, "asked twice"),
    (None, {"cudagraph_capture_sizes": [4], "max_cudagraph_capture_size": 8}, "asked twice"),
    (None, "[1]", "compilation_config must be a JSON object"),
])
def test_what_cannot_run_is_refused(sizes, compilation, match):
    with pytest.raises(ValueError, match=match):
        resolve_graphs(None, sizes, compilation)
