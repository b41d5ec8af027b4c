"""`tokenmill serve`: the OpenAI-compatible server on one model, engine core in its own process."""

from __future__ import annotations

import argparse
import json
import os

from tokenmill.entrypoints.engine_args import add_engine_args
from tokenmill.sampling_params import REASONING_PARSERS


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "serve",
        help="run the OpenAI-compatible HTTP server",
        description="Serve a model over the OpenAI API (/v1/chat/completions, /v1/completions, /v1/models), "
        "with /health, /metrics (Prometheus), /tokenize and /detokenize.",
    )
    parser.add_argument(
        "model_tag", nargs="?", metavar="MODEL", help="the model, as `vllm serve MODEL` takes it (or --model)"
    )
    server = parser.add_argument_group("server options")
    server.add_argument(
        "--host",
        default="0.0.0.0",
        help="address to listen on (default: every IPv4 interface, as vLLM; 127.0.0.1 for this machine only)",
    )
    server.add_argument("--port", type=int, default=8000, help="port to listen on (default: 8000)")
    server.add_argument(
        "--served-model-name",
        nargs="+",
        metavar="NAME",
        help="model name(s) clients pass as `model` (default: the --model argument)",
    )
    server.add_argument(
        "--api-key",
        default=os.environ.get("TOKENMILL_API_KEY"),
        help="require `Authorization: Bearer KEY` on /v1/* (default: $TOKENMILL_API_KEY, else no key)",
    )
    server.add_argument(
        "--shutdown-timeout",
        "--drain-timeout",
        dest="shutdown_timeout",
        type=float,
        default=30.0,
        metavar="SECONDS",
        help="on SIGTERM, how long running requests may take to finish before they are aborted; the "
        "server is gone at most about 2 s later (default: 30; 0 aborts them at once)",
    )
    server.add_argument(
        "--max-request-body-bytes",
        type=_positive_int,
        default=8 << 20,
        metavar="BYTES",
        help="larger request bodies are answered 413 before they are read (default: 8 MiB)",
    )
    server.add_argument(
        "--api-server-count",
        "-asc",
        type=_positive_int,
        default=1,
        metavar="N",
        help="API processes in front of the one engine core; at hundreds of streams one process's core "
        "is spent on HTTP and detokenizing (default: 1)",
    )
    server.add_argument(
        "--data-parallel-size",
        "-dp",
        type=_positive_int,
        default=1,
        metavar="N",
        help="N replicas of the engine (one GPU each where there are N), each its own server on a free "
        "local port, behind the router on --port (default: 1)",
    )
    server.add_argument(
        "--router-policy",
        default="cache_aware",
        choices=("cache_aware", "least_load", "round_robin", "random"),
        help="with --data-parallel-size: how the router spreads requests (default: cache_aware)",
    )
    server.add_argument(
        "--kv-peer",
        action="append",
        metavar="HOST:PORT[,HOST:PORT...]",
        help="with --kv-role decode: the prefill instances' HTTP addresses (repeat or comma-separate); "
        "each request goes to the least loaded one",
    )
    server.add_argument(
        "--remote-prefill-min-tokens",
        type=_positive_int,
        default=256,
        metavar="N",
        help="with --kv-role decode: shorter prompts are prefilled locally (default: 256)",
    )
    server.add_argument(
        "--tool-call-parser",
        choices=("hermes", "llama3_json", "mistral"),
        help="how to find tool calls in what the model writes, for tool_choice 'auto' (vLLM's names)",
    )
    server.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help="answer tool_choice 'auto' (the default with tools) with --tool-call-parser; required and named "
        "tool choices work without it",
    )
    server.add_argument(
        "--reasoning-parser",
        choices=REASONING_PARSERS,
        help="put a model's <think>...</think> into message.reasoning_content (vLLM's names)",
    )
    server.add_argument(
        "--chat-template",
        metavar="FILE_OR_TEMPLATE",
        help="the chat template to use instead of the tokenizer's: a Jinja file, or the template itself",
    )
    server.add_argument(
        "--response-role",
        default="assistant",
        help="the role of chat replies when add_generation_prompt is on (default: assistant)",
    )
    server.add_argument(
        "--enable-log-requests",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="log each request's prompt and sampling parameters as it arrives (default: off)",
    )
    server.add_argument(
        "--disable-log-requests",
        dest="enable_log_requests",
        action="store_false",
        help="vLLM's older spelling of --no-enable-log-requests",
    )
    server.add_argument(
        "--disable-log-stats",
        action="store_true",
        help="accepted as vLLM takes it: this server logs no periodic statistics (they are on /metrics)",
    )
    server.add_argument("--root-path", default="", help="the path prefix a proxy serves this server under")
    server.add_argument(
        "--allowed-origins",
        type=_json_list,
        default=["*"],
        metavar="JSON_LIST",
        help='CORS: origins browsers may call from (default: ["*"])',
    )
    server.add_argument(
        "--allowed-methods", type=_json_list, default=["*"], metavar="JSON_LIST", help='CORS (default: ["*"])'
    )
    server.add_argument(
        "--allowed-headers", type=_json_list, default=["*"], metavar="JSON_LIST", help='CORS (default: ["*"])'
    )
    server.add_argument("--allow-credentials", action="store_true", help="CORS: allow credentials")
    server.add_argument(
        "--log-level", default="info", choices=("debug", "info", "warning", "error"), help="(default: info)"
    )
    server.add_argument(
        "--uvicorn-log-level",
        choices=("debug", "info", "warning", "error", "critical", "trace"),
        help="uvicorn's own log level (default: --log-level)",
    )
    server.add_argument(
        "--access-log", action=argparse.BooleanOptionalAction, default=True, help="log every HTTP request"
    )
    add_engine_args(parser, exclude=("reasoning_parser",))  # the server's own flag above (with its choices)
    parser.set_defaults(func=_run)


def _positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {text}")
    return value


def _json_list(text: str) -> list[str]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        value = None
    if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
        raise argparse.ArgumentTypeError(f"not a JSON list of strings: {text!r} (e.g. '[\"*\"]')")
    return value


def _run(args: argparse.Namespace) -> int:
    # Imported here so that `tokenmill --help` and the other subcommands start without FastAPI and torch.
    from tokenmill.entrypoints.openai.api_server import run_server

    if args.model_tag is not None:
        if args.model not in ("default", args.model_tag):
            raise SystemExit(f"two models given: {args.model_tag} and --model {args.model}; give one")
        args.model = args.model_tag

    if args.enable_auto_tool_choice and not args.tool_call_parser:
        raise SystemExit(
            "--enable-auto-tool-choice needs --tool-call-parser (hermes, llama3_json or mistral)"
        )

    if args.kv_role == "decode" and not args.kv_peer:
        raise SystemExit(
            "--kv-role decode needs --kv-peer HOST:PORT (a server started with --kv-role prefill)"
        )
    if args.data_parallel_size > 1:
        from tokenmill.entrypoints.data_parallel import run_data_parallel

        return run_data_parallel(args)
    return run_server(args)
