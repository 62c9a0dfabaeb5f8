"""checkpoint_formats' --formats entries: what LLM options each one asks for."""

from tokenmill.bench.checkpoint_formats import _engine_args


def test_format_entries_become_engine_options():
    assert _engine_args("/m", "auto") == ("/m", {})
    assert _engine_args("/m", "float32@kv=bfloat16") == (
        "/m", {"dtype": "float32", "kv_cache_dtype": "bfloat16"})
    assert _engine_args("/m", "f.gguf@int8@matmul=float32@block=64") == (
        "f.gguf", {"quantization": "int8", "matmul_dtype": "float32", "block_size": 64})
