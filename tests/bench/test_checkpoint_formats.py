"""checkpoint_formats: what LLM options each --formats entry asks for; the figure compared."""

from tokenmill.bench.checkpoint_formats import _engine_args


def test_format_entries_become_engine_options():
    assert _engine_args("/m", "auto") == ("/m", {})
    assert _engine_args("/m", "float32@kv=bfloat16") == (
        "/m", {"dtype": "float32", "kv_cache_dtype": "bfloat16"})
    assert _engine_args("/m", "f.gguf@int8@matmul=float32@block=64") == (
        "f.gguf", {"quantization": "int8", "matmul_dtype": "float32", "block_size": 64})


def test_a_format_is_compared_by_its_rounds_after_the_first():
    """The first round pays the engine's one-time costs (the KV cache's first touch), which
    vLLM pays at start-up: the compared figure is the median of the later rounds."""
    from tokenmill.bench.checkpoint_formats import warm_rate

    assert warm_rate([100.0, 300.0, 200.0, 250.0]) == 250.0
    assert warm_rate([100.0, 300.0]) == 300.0
    assert warm_rate([100.0]) == 100.0  # --rounds 1: the cold round alone
