"""The `tokenmill` command.

    tokenmill serve [MODEL] [--host 127.0.0.1] [--port 8000] [--api-key KEY]
                    [--served-model-name NAME] [--max-waiting-requests 256]
                    [--max-request-body-bytes 8MiB] [--request-timeout S]
                    [--drain-timeout 30] [--enable-auto-tool-choice --tool-call-parser P]
                    [--data-parallel-size D [--data-parallel-router cache_aware|round_robin]]
                    [engine options]
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
from typing import Any


def add_engine_args(p: argparse.ArgumentParser) -> None:
    from tokenmill.attention.base import BACKEND_NAMES
    from tokenmill.attention.kv_formats import PLANNED_KV_FORMATS, kv_format_names

    g = p.add_argument_group("engine")
    g.add_argument("--model", default=None,
                   help="a Hugging Face folder, a .gguf file or a Hub id (ORG/NAME, "
                   "ORG/NAME:Q4_K_M, ORG/NAME/FILE.gguf; default: SmolLM2-135M-Instruct)")
    g.add_argument("--revision", default=None,
                   help="a Hub model's branch, tag or commit (default: main)")
    g.add_argument("--download-dir", default=None,
                   help="the Hugging Face cache to read and download Hub models into "
                   "(default: HF_HUB_CACHE / HF_HOME's)")
    g.add_argument("--tokenizer", default=None,
                   help="a tokenizer folder or Hub id to use instead of the model's own (e.g. "
                   "the original repository of a GGUF file)")
    g.add_argument("--dtype", default=None, help="auto, float32, bfloat16 or float16")
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--load-format", choices=["auto", "dummy"], default=None,
                   help="dummy: seeded random weights of the model's shape (benchmarks)")
    g.add_argument("--quantization", "-q", default=None,
                   choices=["none", "int8", "int4", "awq", "gptq", "gguf"],
                   help="weight format: int8 / int4 quantize a float checkpoint at load; "
                        "awq / gptq read such checkpoints (the default for them); gguf "
                        "serves a GGUF file's blocks as stored (the default for a quantized "
                        "GGUF on AVX-512 VNNI CPUs); none: dense, a GGUF expanded to float32")
    g.add_argument("--int8-activations", action="store_true", default=None,
                   help="quantized weights: every step multiplies int8-quantized activations "
                        "(llama.cpp's numbers; faster, slightly less exact)")
    g.add_argument("--kv-cache-memory", default=None,
                   help="KV cache size: bytes or e.g. 512MiB, 4GiB (default: half the memory "
                        "free after the weights on CPU, 2GiB on GPU; logged)")
    g.add_argument("--num-kv-blocks", type=int, default=None,
                   help="exact number of KV blocks (overrides --kv-cache-memory)")
    g.add_argument("--kv-cache-dtype", choices=[*kv_format_names(), *PLANNED_KV_FORMATS],
                   default=None,
                   help="KV cache storage (vLLM's flag): auto = the model's dtype; bfloat16 = "
                        "half a float32 model's bytes; int8 = one "
                        "scale per token and KV head, ~3.8x the tokens; fp8 (= fp8_e4m3) = "
                        "e4m3 with a per-head scale, 4x; fp8_e5m2 is not built yet")
    g.add_argument("--block-size", type=int, default=None)
    g.add_argument("--max-num-seqs", type=int, default=None)
    g.add_argument("--max-num-batched-tokens", type=int, default=None)
    g.add_argument("--no-chunked-prefill", dest="enable_chunked_prefill",
                   action="store_false", default=None)
    g.add_argument("--no-prefix-caching", dest="enable_prefix_caching",
                   action="store_false", default=None)
    g.add_argument("--preemption-mode", choices=["recompute", "swap"], default=None)
    g.add_argument("--swap-space", default=None, help="CPU memory for swapped KV, e.g. 1GiB")
    g.add_argument("--async-scheduling", action="store_true", default=None,
                   help="schedule each step while the model runs the one before")
    g.add_argument("--device", default=None)
    g.add_argument("--attention-backend", default=None, choices=BACKEND_NAMES)
    g.add_argument("--prepack-weights", dest="prepack_weights", action="store_true",
                   default=None, help="CPU float32: keep a oneDNN-packed copy of each weight "
                   "for large batches (default: for models up to 5 GiB of weights)")
    g.add_argument("--no-prepack-weights", dest="prepack_weights", action="store_false",
                   default=None, help="CPU float32: no packed copy (half the weight memory)")
    g.add_argument("--batch-invariant", dest="batch_invariant", action="store_true",
                   default=None, help="a request's tokens never depend on what shares its "
                   "step (the default on CPU in float32)")
    g.add_argument("--no-batch-invariant", dest="batch_invariant", action="store_false",
                   default=None, help="the fastest kernel for each step size instead (results "
                   "may then vary in the last bits with the batch)")
    g.add_argument("--enforce-eager", action="store_true", default=None,
                   help="CUDA: run decode steps eagerly, without CUDA graphs")
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--speculative-config", dest="speculative_config", default=None,
                   help='speculative decoding as JSON (vLLM\'s flag): method "ngram", '
                        '"suffix" or "draft_model" (with "model" and/or "quantization"), e.g. '
                        '\'{"method": "suffix", "num_speculative_tokens": 3}\'')
    g.add_argument("--runner", default=None, choices=("auto", "generate", "pooling"),
                   help="vLLM's flag: 'pooling' serves embeddings only (/v1/embeddings), "
                   "'generate' text only; 'auto' (default) both")
    g.add_argument("--pooler-config", dest="pooler_config", default=None,
                   help='embeddings\' pooling as JSON (vLLM\'s flag): "pooling_type" ("LAST", '
                   'the default, or "MEAN") and "normalize" (true, the default, or false)')
    g.add_argument("--structured-outputs-config", dest="structured_outputs_config",
                   default=None, help='structured outputs as JSON (vLLM\'s flag): "backend" '
                   '("auto", "guidance" or "xgrammar") and "jump_forward" (true or false)')
    g.add_argument("--tensor-parallel-size", "-tp", type=int, default=None,
                   help="split the model's heads, MLP and vocabulary over this many worker "
                        "processes (gloo on CPU, NCCL on CUDA)")
    g.add_argument("--pipeline-parallel-size", "-pp", type=int, default=None,
                   help="split the model's layers into this many stages, one worker process "
                        "(or tensor-parallel group) each, steps in flight through them")
    g.add_argument("--data-parallel-size", "-dp", type=int, default=None,
                   help="serve this many engine replicas behind one API server, each with "
                        "its own KV cache and worker processes (tokenmill serve only)")
    g.add_argument("--distributed-executor-backend", choices=["uni", "mp", "ray"],
                   default=None,
                   help="where the ranks run: uni (this process, size 1), mp (one process "
                        "per rank; the default above size 1), ray (Ray actors on a Ray "
                        "cluster's machines: docs/parallel.md)")


def engine_options(args: argparse.Namespace) -> dict[str, Any]:
    names = ["revision", "download_dir", "tokenizer", "dtype", "max_model_len", "load_format",
             "quantization", "int8_activations",
             "kv_cache_memory", "kv_cache_dtype",
             "num_kv_blocks", "block_size", "max_num_seqs",
             "max_num_batched_tokens", "enable_chunked_prefill", "enable_prefix_caching",
             "preemption_mode", "async_scheduling", "swap_space", "device", "seed",
             "prepack_weights",
             "attention_backend", "batch_invariant", "enforce_eager", "speculative_config",
             "structured_outputs_config", "runner", "pooler_config", "tensor_parallel_size",
             "pipeline_parallel_size", "data_parallel_size", "distributed_executor_backend"]
    return {n: getattr(args, n) for n in names if getattr(args, n) is not None}


def _generate(args: argparse.Namespace) -> int:
    from tokenmill import LLM, SamplingParams

    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                            top_p=args.top_p, top_k=args.top_k, seed=args.sampling_seed)
    llm = LLM(args.model, **engine_options(args))
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
    from tokenmill.server.tools import ToolOptions
    from tokenmill.utils.request_context import RequestIdFilter
    from tokenmill.utils.sizes import parse_size

    # Serving logs what it does (start-up phases, one line per request) with request ids.
    handler = logging.StreamHandler()
    handler.addFilter(RequestIdFilter())
    handler.setFormatter(logging.Formatter(
        "%(asctime)s %(levelname)s [%(request_id)s] %(name)s: %(message)s"))
    logging.basicConfig(level=logging.INFO, handlers=[handler], force=True)
    limits = ServerLimits(max_waiting_requests=args.max_waiting_requests,
                          max_request_body_bytes=parse_size(args.max_request_body_bytes),
                          request_timeout=args.request_timeout, drain_timeout=args.drain_timeout)
    tools = ToolOptions(args.enable_auto_tool_choice, args.tool_call_parser)
    model = args.model_pos if args.model_pos is not None else args.model
    return run_server(make_replicas(model, **engine_options(args)), args.host, args.port,
                      args.api_key, args.served_model_name, limits, tools,
                      args.data_parallel_router)


def build_parser() -> argparse.ArgumentParser:
    from tokenmill.engine.dp_router import ROUTERS
    from tokenmill.server.tool_parsers import TOOL_PARSERS

    parser = argparse.ArgumentParser(prog="tokenmill", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
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
    add_engine_args(gen)
    gen.set_defaults(func=_generate)

    bench = sub.add_parser("bench", help="benchmarks")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    bench_serve = bench_sub.add_parser("serve", help="load-test an OpenAI-compatible server")
    from tokenmill.bench import latency, serve_command, throughput

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

    serve = sub.add_parser("serve", help="serve the OpenAI-compatible HTTP API")
    serve.add_argument("model_pos", nargs="?", metavar="MODEL", default=None,
                       help="a Hugging Face folder, a .gguf file or a Hub id (ORG/NAME, "
                   "ORG/NAME:Q4_K_M, ORG/NAME/FILE.gguf; default: SmolLM2-135M-Instruct)")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--api-key", default=None,
                       help="require `Authorization: Bearer KEY` on /v1 routes")
    serve.add_argument("--served-model-name", default=None,
                       help="the model name clients use (default: the model file's name)")
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
                            "(<tool_call> tags: Hermes, Qwen) or llama3_json (Llama 3.x)")
    serve.add_argument("--data-parallel-router", choices=ROUTERS,
                       default="cache_aware",
                       help="with --data-parallel-size: send each request to the replica "
                            "likely to hold its prompt's prefix in cache unless it is "
                            "overloaded (cache_aware, SGLang's policy), or in turn")
    add_engine_args(serve)
    serve.set_defaults(func=_serve)
    return parser


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
