"""How a server meets browsers, proxies and TLS (vLLM's flags): CORS preflights answered
before the API key is asked (any origin by default, vLLM's; a list when given), the root path
in the OpenAPI document, the docs routes turned off, TLS from a key and certificate; and the
serve command's parsing of those flags."""

from __future__ import annotations

import logging
import shutil
import ssl
import subprocess

import httpx
import pytest

from tests.server.conftest import start_server
from tokenmill.cli import build_parser, http_options, main
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.server.http_options import HttpOptions

PREFLIGHT = {"Access-Control-Request-Method": "POST",
             "Access-Control-Request-Headers": "authorization, content-type"}


@pytest.fixture(scope="module")
def engine(tiny_model) -> LLMEngine:
    return LLMEngine.from_options(tiny_model("llama")[0], max_model_len=256, num_kv_blocks=64)


def test_cors_by_default_and_before_the_api_key(engine):
    for srv in start_server(engine, "m", api_key="secret"):
        pre = httpx.options(f"{srv.base_url}/v1/chat/completions",
                            headers={"Origin": "https://ui.example", **PREFLIGHT})
        get = httpx.get(f"{srv.base_url}/v1/models", headers={
            "Origin": "https://ui.example", "Authorization": "Bearer secret"})
    assert pre.status_code == 200  # a preflight carries no key: it is answered anyway
    assert pre.headers["access-control-allow-origin"] == "*"
    assert get.status_code == 200 and get.headers["access-control-allow-origin"] == "*"


def test_allowed_origins_root_path_and_no_docs(engine):
    http = HttpOptions(allowed_origins=("https://ui.example",), root_path="/proxied",
                       docs=False)
    for srv in start_server(engine, "m", http=http):
        ok = httpx.options(f"{srv.base_url}/v1/completions",
                           headers={"Origin": "https://ui.example", **PREFLIGHT})
        other = httpx.options(f"{srv.base_url}/v1/completions",
                              headers={"Origin": "https://evil.example", **PREFLIGHT})
        docs = [httpx.get(f"{srv.base_url}{p}").status_code
                for p in ("/docs", "/redoc", "/openapi.json")]
        models = httpx.get(f"{srv.base_url}/v1/models")
    assert ok.status_code == 200
    assert ok.headers["access-control-allow-origin"] == "https://ui.example"
    assert other.status_code == 400 and "access-control-allow-origin" not in other.headers
    assert docs == [404, 404, 404] and models.status_code == 200


def test_root_path_names_the_proxied_prefix_in_openapi(engine):
    for srv in start_server(engine, "m", http=HttpOptions(root_path="/proxied")):
        schema = httpx.get(f"{srv.base_url}/openapi.json").json()
    assert schema["servers"] == [{"url": "/proxied"}]


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs openssl to make a cert")
def test_tls_from_a_key_and_certificate(engine, tmp_path):
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
                    "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True)
    http = HttpOptions(ssl_keyfile=str(key), ssl_certfile=str(cert))
    for srv in start_server(engine, "m", http=http):
        assert srv.base_url.startswith("https://")
        r = httpx.get(f"{srv.base_url}/health",
                      verify=ssl.create_default_context(cafile=str(cert)))
        with pytest.raises(httpx.HTTPError):  # plain HTTP is not served
            httpx.get(srv.base_url.replace("https", "http") + "/health", timeout=5)
    assert r.status_code == 200


def test_serve_parses_the_http_flags():
    parser = build_parser()
    args = parser.parse_args([
        "serve", "m", "--allowed-origins", '["https://a.example"]', "--allowed-methods",
        '["GET", "POST"]', "--allow-credentials", "--root-path", "/x",
        "--disable-fastapi-docs", "--ssl-keyfile", "k.pem", "--ssl-certfile", "c.pem",
        "--ssl-cert-reqs", "2"])
    assert http_options(args) == HttpOptions(
        allowed_origins=("https://a.example",), allowed_methods=("GET", "POST"),
        allow_credentials=True, root_path="/x", docs=False, ssl_keyfile="k.pem",
        ssl_certfile="c.pem", ssl_cert_reqs=2)
    assert http_options(parser.parse_args(["serve", "m"])) == HttpOptions()
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "m", "--allowed-origins", "https://a.example"])


def test_half_a_tls_pair_fails_before_the_model_loads(capsys):
    handlers = logging.getLogger().handlers[:]
    assert main(["serve", "/nonexistent/model", "--ssl-keyfile", "k.pem"]) == 2
    assert logging.getLogger().handlers == handlers  # (before serving's logging is set up)
    assert "--ssl-keyfile and --ssl-certfile go together" in capsys.readouterr().err


def test_several_api_servers_are_refused_with_the_reason(capsys):
    assert main(["serve", "/nonexistent/model", "--api-server-count", "2"]) == 2
    assert "--api-server-count 2: tokenmill serves from one API server process" in \
        capsys.readouterr().err
