"""The `tokenmill` command.

    tokenmill serve [MODEL] [--host 127.0.0.1] [--port 8000] [--api-key KEY]
                    [--served-model-name NAME] [--max-waiting-requests 256]
                    [--max-request-body-bytes 8MiB] [--request-timeout S]
                    [--drain-timeout 30] [--enable-auto-tool-choice --tool-call-parser P]
                    [--data-parallel-size D [--data-parallel-router cache_aware|round_robin]]
                    [engine options]
    tokenmill proxy --prefill URL [URL ...] --decode URL [URL ...] [--host H] [--port P]
    tokenmill bench serve [--launch | --base-url URL] [--request-rate R | --concurrency C]
    tokenmill bench throughput [--workload mixed|uniform] [--compare-hf] [--json F] [--png F]
    tokenmill bench latency [--repeats 3] [--llama-cpp] [--json F] [--png F]
    tokenmill generate --prompt "What is the capital of France?" [--chat] [--model PATH]
                       [--max-tokens N] [--temperature T] [--top-p P] [--top-k K] [--seed S]
                       [engine options: --kv-cache-memory 1GiB --max-num-seqs ... ]

With no model it runs the default model, SmolLM2-135M-Instruct.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from tokenmill.bench import latency, serve_command, throughput
from tokenmill.engine.dp_router import ROUTERS
from tokenmill.engine_args import EngineArgs
from tokenmill.server.tool_parsers import TOOL_PARSERS

if TYPE_CHECKING:
    from tokenmill.server.api_server import ServerLogging
    from tokenmill.server.http_options import HttpOptions
    from tokenmill.server.serving_common import ServingOptions


def _generate(args: argparse.Namespace) -> int:
    from tokenmill import LLM, SamplingParams

    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                            top_p=args.top_p, top_k=args.top_k, seed=args.sampling_seed)
    llm = LLM(args.model, **EngineArgs.cli_options(args))
    if args.chat:
        outs = llm.chat([[{"role": "user", "content": p}] for p in args.prompt], params,
                        use_tqdm=False)
    else:
        outs = llm.generate(args.prompt, params, use_tqdm=False)
    for out in outs:
        if len(outs) > 1:
            print(f"--- {out.prompt!r}")
        print(out.outputs[0].text)
    return 0


def _serve(args: argparse.Namespace) -> int:
    from tokenmill.engine.data_parallel import make_replicas
    from tokenmill.server.api_server import ServerLimits, run_server
    from tokenmill.server.lora_modules import parse_lora_modules
    from tokenmill.server.tools import ToolOptions
    from tokenmill.utils.request_context import RequestIdFilter
    from tokenmill.utils.sizes import parse_size

    # the server's own options first: a bad one is refused before anything else happens
    limits = ServerLimits(max_waiting_requests=args.max_waiting_requests,
                          max_request_body_bytes=parse_size(args.max_request_body_bytes),
                          request_timeout=args.request_timeout, drain_timeout=args.drain_timeout)
    tools = ToolOptions(args.enable_auto_tool_choice, args.tool_call_parser)
    lora_modules = parse_lora_modules(args.lora_modules)
    if lora_modules and not args.enable_lora:
        raise ValueError("--lora-modules needs --enable-lora")
    if args.api_server_count != 1:
        raise ValueError(f"--api-server-count {args.api_server_count}: tokenmill serves from one "
                         "API server process, which holds the engine (vLLM's engine core "
                         "process that several API servers share is not built); use 1")
    log, http = server_logging(args), http_options(args)
    # Serving logs what it does (start-up phases, one line per request) with request ids.
    handler = logging.StreamHandler()
    handler.addFilter(RequestIdFilter())
    handler.setFormatter(logging.Formatter(
        "%(asctime)s %(levelname)s [%(request_id)s] %(name)s: %(message)s"))
    logging.basicConfig(level=logging.INFO, handlers=[handler], force=True)
    engine_args = EngineArgs.from_cli_args(args, model=args.model_pos)
    return run_server(make_replicas(engine_args), args.host, args.port,
                      args.api_key, args.served_model_name, limits, tools,
                      args.data_parallel_router, lora_modules, log, http,
                      serving_options(args))


def http_options(args: argparse.Namespace) -> HttpOptions:
    """What `tokenmill serve`'s CORS, root path, docs and TLS flags ask."""
    from tokenmill.server.http_options import HttpOptions

    return HttpOptions(
        allowed_origins=tuple(args.allowed_origins), allowed_methods=tuple(args.allowed_methods),
        allowed_headers=tuple(args.allowed_headers), allow_credentials=args.allow_credentials,
        root_path=args.root_path, docs=not args.disable_fastapi_docs,
        ssl_keyfile=args.ssl_keyfile, ssl_certfile=args.ssl_certfile,
        ssl_ca_certs=args.ssl_ca_certs, ssl_cert_reqs=args.ssl_cert_reqs)


def serving_options(args: argparse.Namespace) -> ServingOptions:
    """What `tokenmill serve`'s answer flags ask (usage details, forced usage, the role)."""
    from tokenmill.server.serving_common import ServingOptions

    return ServingOptions(prompt_tokens_details=args.enable_prompt_tokens_details,
                          force_include_usage=args.enable_force_include_usage,
                          response_role=args.response_role,
                          tokens_as_ids=args.return_tokens_as_token_ids,
                          trust_request_chat_template=args.trust_request_chat_template)


def server_logging(args: argparse.Namespace) -> ServerLogging:
    """What `tokenmill serve`'s logging flags ask."""
    from tokenmill.server.api_server import ServerLogging

    return ServerLogging(log_stats=not args.disable_log_stats,
                         log_requests=args.enable_log_requests, max_log_len=args.max_log_len,
                         access_log=not args.disable_uvicorn_access_log,
                         uvicorn_log_level=args.uvicorn_log_level)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tokenmill", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    _add_generate(sub)
    _add_bench(sub)
    _add_serve(sub)
    _add_proxy(sub)
    return parser


def _add_generate(sub: argparse._SubParsersAction) -> None:
    gen = sub.add_parser("generate", help="generate text for one or more prompts")
    gen.add_argument("--prompt", action="append", required=True,
                     help="prompt text (repeat for a batch)")
    gen.add_argument("--chat", action="store_true",
                     help="wrap each prompt as a user message in the chat template")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--sampling-seed", type=int, default=None)
    EngineArgs.add_cli_args(gen)
    gen.set_defaults(func=_generate)


def _add_bench(sub: argparse._SubParsersAction) -> None:
    bench = sub.add_parser("bench", help="benchmarks")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    bench_serve = bench_sub.add_parser("serve", help="load-test an OpenAI-compatible server")
    serve_command.add_arguments(bench_serve)
    bench_serve.set_defaults(func=serve_command.run)
    bench_tp = bench_sub.add_parser("throughput", help="offline throughput on a standard "
                                    "workload (optionally against Hugging Face)")
    throughput.add_arguments(bench_tp)
    bench_tp.set_defaults(func=throughput.run)
    bench_lat = bench_sub.add_parser("latency", help="single-stream time to first token and "
                                     "decode speed (optionally against llama.cpp)")
    latency.add_arguments(bench_lat)
    bench_lat.set_defaults(func=latency.run)


def _add_serve(sub: argparse._SubParsersAction) -> None:
    serve = sub.add_parser("serve", help="serve the OpenAI-compatible HTTP API")
    serve.add_argument("model_pos", nargs="?", metavar="MODEL", default=None,
                       help="a Hugging Face folder, a .gguf file or a Hub id (ORG/NAME, "
                   "ORG/NAME:Q4_K_M, ORG/NAME/FILE.gguf; default: SmolLM2-135M-Instruct)")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--api-key", default=None,
                       help="require `Authorization: Bearer KEY` on /v1 routes")
    serve.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                       help="the model name(s) clients use; a request may name any, answers "
                            "name the first (default: the model file's name)")
    serve.add_argument("--max-waiting-requests", type=int, default=256,
                       help="sequences admitted beyond --max-num-seqs; more get 429")
    serve.add_argument("--max-request-body-bytes", default="8MiB",
                       help="larger request bodies get 413 (bytes or e.g. 8MiB)")
    serve.add_argument("--request-timeout", type=float, default=None,
                       help="seconds after which any request is aborted (finish_reason "
                            "'abort'); a request's own `timeout` field may be shorter")
    serve.add_argument("--drain-timeout", type=float, default=30.0,
                       help="on SIGTERM/SIGINT, seconds in-flight requests get to finish")
    serve.add_argument("--enable-auto-tool-choice", action="store_true",
                       help='let the model decide when to call tools (tool_choice "auto"); '
                            "needs --tool-call-parser")
    serve.add_argument("--tool-call-parser", choices=sorted(TOOL_PARSERS), default=None,
                       help="how tool calls are parsed out of the model's text: hermes "
                            "(<tool_call> tags: Hermes, Qwen), llama3_json (Llama 3.x), "
                            "pythonic ([f(x=1)]: Llama 3.2 / 4), mistral ([TOOL_CALLS]), "
                            "granite (Granite 3.x), phi4_mini_json (Phi-4-mini) or "
                            "qwen3_coder (Qwen3-Coder's XML calls)")
    serve.add_argument("--trust-request-chat-template", action="store_true",
                       help="let a chat request bring its own chat_template (vLLM's; a "
                            "template is code the server runs)")
    serve.add_argument("--data-parallel-router", choices=ROUTERS,
                       default="cache_aware",
                       help="with --data-parallel-size: send each request to the replica "
                            "likely to hold its prompt's prefix in cache unless it is "
                            "overloaded (cache_aware, SGLang's policy), or in turn")
    serve.add_argument("--api-server-count", type=int, default=1, metavar="N",
                       help="vLLM's flag: API server processes; tokenmill runs one (the "
                            "engine in the same process), so only 1 is served")
    serve.add_argument("--lora-modules", nargs="+", default=[], metavar="NAME=PATH",
                       help="LoRA adapters served by name (with --enable-lora): name=path or "
                            'JSON \'{"name": ..., "path": ..., "base_model_name": ...}\'; a '
                            "request's `model` picks one")
    _add_logging(serve)
    _add_http(serve)
    EngineArgs.add_cli_args(serve)
    serve.set_defaults(func=_serve)


def _add_http(serve: argparse.ArgumentParser) -> None:
    """CORS, the root path, the docs routes and TLS, under vLLM's flag names."""
    from tokenmill.server.http_options import json_list

    http = serve.add_argument_group("http")
    for what in ("origins", "methods", "headers"):
        http.add_argument(f"--allowed-{what}", type=_argparse_type(json_list), default=["*"],
                          help=f'CORS: the allowed {what} as a JSON list (default ["*"])')
    http.add_argument("--allow-credentials", action="store_true",
                      help="CORS: allow credentials")
    http.add_argument("--root-path", default="",
                      help="the path prefix a path-routing proxy serves this server under")
    http.add_argument("--disable-fastapi-docs", action="store_true",
                      help="no /docs, /redoc or /openapi.json")
    http.add_argument("--ssl-keyfile", default=None, help="TLS: the key file")
    http.add_argument("--ssl-certfile", default=None, help="TLS: the certificate file")
    http.add_argument("--ssl-ca-certs", default=None, help="TLS: the CA certificates file")
    http.add_argument("--ssl-cert-reqs", type=int, default=0,
                      help="TLS: whether a client certificate is required (ssl.CERT_*: 0 "
                           "none, 1 optional, 2 required)")


def _argparse_type(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    """`parse` with its ValueError as argparse's usage error."""
    def parsed(value: str) -> Any:
        try:
            return parse(value)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from e
    return parsed


def _add_logging(serve: argparse.ArgumentParser) -> None:
    """What the server logs, and what usage its answers carry, under vLLM's flag names."""
    log = serve.add_argument_group("logging and usage")
    log.add_argument("--disable-log-stats", action="store_true",
                     help="no periodic engine line (throughputs, running and waiting "
                          "requests, KV cache usage, prefix cache hit rate; every 10 s)")
    log.add_argument("--enable-log-requests", action="store_true", default=False,
                     help="log each request's prompt and sampling parameters")
    log.add_argument("--disable-log-requests", dest="enable_log_requests",
                     action="store_false", help="(the default) vLLM's older spelling")
    log.add_argument("--max-log-len", type=int, default=None,
                     help="with --enable-log-requests: prompt characters (or token ids) "
                          "logged (default: all)")
    log.add_argument("--enable-request-id-headers", action="store_true",
                     help="(always on here: every answer carries X-Request-Id) vLLM's flag")
    log.add_argument("--disable-uvicorn-access-log", action="store_true",
                     help="no line per HTTP request (method, path, status, seconds)")
    log.add_argument("--enable-prompt-tokens-details", action="store_true",
                     help="usage.prompt_tokens_details.cached_tokens: the prompt tokens "
                          "served from the prefix cache (or a KV tier)")
    log.add_argument("--enable-force-include-usage", action="store_true",
                     help="every stream ends with a usage chunk, asked or not")
    log.add_argument("--response-role", default="assistant",
                     help="the role of chat answers to a generation prompt")
    log.add_argument("--return-tokens-as-token-ids", action="store_true",
                     help='logprobs name tokens "token_id:N" instead of their text (a '
                          "request's return_tokens_as_token_ids field decides for itself)")
    log.add_argument("--uvicorn-log-level", default="info",
                     choices=["critical", "error", "warning", "info", "debug", "trace"],
                     help="uvicorn's own log level")


def _add_proxy(sub: argparse._SubParsersAction) -> None:
    proxy = sub.add_parser(
        "proxy", help="disaggregated prefill / decode: send each request to a prefill "
        "instance (kv_producer), then to a decode instance (kv_consumer)")
    proxy.add_argument("--host", default="127.0.0.1")
    proxy.add_argument("--port", type=int, default=8000)
    proxy.add_argument("--prefill", nargs="+", required=True, metavar="URL",
                       help="prefill instances (tokenmill serve with a kv_producer "
                            "--kv-transfer-config), taken in turn")
    proxy.add_argument("--decode", nargs="+", required=True, metavar="URL",
                       help="decode instances (kv_consumer), taken in turn")
    proxy.add_argument("--timeout", type=float, default=None,
                       help="seconds to wait for an instance (default: no limit)")
    proxy.set_defaults(func=_proxy)


def _proxy(args: argparse.Namespace) -> int:
    import uvicorn

    from tokenmill.server.disagg_proxy import build_proxy_app

    logging.basicConfig(level=logging.INFO, force=True)
    app = build_proxy_app(args.prefill, args.decode, args.timeout)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
