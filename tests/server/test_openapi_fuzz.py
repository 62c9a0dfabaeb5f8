"""A bounded schemathesis run over the server's own OpenAPI schema, against a real server on a
tiny model: requests generated from the schema (valid and invalid) never get a 5xx, every
status returned is one the schema documents (400 for validation errors, never FastAPI's 422),
responses have the documented content types and shapes, and data the schema forbids is
refused. A hook caps max_tokens and n so that each generated request is cheap."""

from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import checks

from tests.server.conftest import start_server
from tokenmill.engine.llm_engine import LLMEngine

CAPS = {"max_tokens": 8, "max_completion_tokens": 8, "min_tokens": 8, "n": 4,
        "top_logprobs": 5, "logprobs": 5, "prompt_logprobs": 5, "timeout": 30.0}


@pytest.fixture(scope="module")
def fuzz_server(tiny_model):
    path, _ = tiny_model("llama")
    engine = LLMEngine.from_options(path, max_model_len=256, num_kv_blocks=600)
    yield from start_server(engine, "tiny-llama")


def cap_body(ctx, body):  # noqa: ARG001 - schemathesis' hook signature
    """Cheap requests that reach the engine: capped work, and the served model's name (an
    unknown name is a 404 before anything else is looked at; tested elsewhere)."""
    if isinstance(body, dict):
        if isinstance(body.get("model"), str):
            body["model"] = "tiny-llama"
        for key, cap in CAPS.items():
            value = body.get(key)
            if isinstance(value, int | float) and not isinstance(value, bool) and value > cap:
                body[key] = type(value)(cap)
    return body


CHECKS = [checks.not_a_server_error, checks.status_code_conformance,
          checks.content_type_conformance, checks.response_schema_conformance,
          checks.negative_data_rejection]


def test_schema_documents_400_not_422(fuzz_server):
    import httpx

    paths = httpx.get(f"{fuzz_server.base_url}/openapi.json").json()["paths"]
    assert "post" in paths["/ping"]  # (SageMaker's health route takes no body)
    posts = [ops["post"] for path, ops in paths.items() if "post" in ops and path != "/ping"]
    # completions, chat, responses, embeddings, tokenize, detokenize, messages,
    # messages/count_tokens
    assert len(posts) == 8
    for op in posts:
        assert "422" not in op["responses"]
        assert {"400", "413", "429"} <= set(op["responses"])


@pytest.mark.parametrize("mode", list(schemathesis.GenerationMode))
def test_generated_requests(fuzz_server, mode):
    schema = schemathesis.openapi.from_url(f"{fuzz_server.base_url}/openapi.json")
    schema.hook("map_body")(cap_body)
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 8  # every route is in the schema
    for op in operations:
        if mode == schemathesis.GenerationMode.NEGATIVE and (op.method.upper() != "POST"
                                                             or op.path == "/ping"):
            continue  # nothing to get wrong in a route without parameters or body
        @given(case=op.as_strategy(generation_mode=mode))
        @settings(max_examples=40, deadline=None, derandomize=True, database=None,
                  suppress_health_check=list(HealthCheck))
        def run(case: schemathesis.Case) -> None:
            response = case.call(timeout=60)
            case.validate_response(response, checks=CHECKS)

        run()
    fuzz_server.wait_idle()
