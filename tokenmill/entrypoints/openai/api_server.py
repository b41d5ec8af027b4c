"""The OpenAI-compatible HTTP server: the FastAPI app (routes, errors; its middlewares in middleware.py)
and its life under uvicorn: SIGTERM or Ctrl-C drains (health 503, new requests refused, running ones
finish within a grace period, exit 0); if the engine-core process dies, open requests fail at once and
the server exits 1."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import functools
import logging
import signal
import socket
import sys
import time

import uvicorn
import uvloop
from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.responses import Response

from tokenmill import __version__
from tokenmill.entrypoints.engine_args import engine_config_from_args
from tokenmill.entrypoints.generation_config import default_sampling_params, describe
from tokenmill.gc_pauses import SERVER_LOG_OVER_S, GCPauses, freeze_startup
from tokenmill.serving.async_client import AsyncEngineClient
from tokenmill.serving.metrics import ServerMetrics
from tokenmill.serving.prompt import render_prompt
from tokenmill.thinking import check_reasoning_tokens

from .common import ServerState
from .disagg import PrefillPeers, kv_address
from .errors import bad_request, install_error_handlers, unavailable
from .middleware import ApiKeyCheck, BodySizeLimit
from .protocol import ChatCompletionRequest, CompletionRequest
from .serving_chat import ChatServing, render_chat
from .serving_completion import CompletionServing
from .serving_embedding import EmbeddingServing
from .tokenize_embed_protocol import DetokenizeRequest, EmbeddingRequest, TokenizeRequest

logger = logging.getLogger("tokenmill.server")

# After the engine dies the server answers /health with 503 this long before it exits, so whoever
# polls it (a load balancer, a person) sees why the replica is going away.
_DEATH_LINGER_S = 2.0
# Past the drain, what shutting down may take: open connections to close, the engine core to stop (a
# core in the middle of a long step is killed after this).
_STOP_S = 1.5


def build_app(
    state: ServerState, max_request_body_bytes: int = 8 << 20, root_path: str = "", cors: dict | None = None
) -> FastAPI:
    """cors: CORSMiddleware's allow_* options (vLLM's --allowed-origins ...); None answers no CORS."""
    app = FastAPI(
        title="tokenmill", version=__version__, docs_url=None, redoc_url=None, openapi_url=None,
        root_path=root_path,
    )  # fmt: skip
    install_error_handlers(app)
    if state.api_key:
        app.add_middleware(ApiKeyCheck, api_key=state.api_key)
    app.add_middleware(BodySizeLimit, max_bytes=max_request_body_bytes)
    if cors is not None:  # outermost: a browser's preflight is answered before any other check
        app.add_middleware(CORSMiddleware, **cors)
    chat, completion, embedding = ChatServing(state), CompletionServing(state), EmbeddingServing(state)
    engine = state.engine
    created = int(time.time())

    @app.get("/health")
    async def health() -> Response:
        if engine.dead_error is not None:
            return unavailable(engine.dead_error, "engine_dead").response()
        if state.draining:
            return unavailable("the server is draining before it shuts down.", "draining").response()
        return JSONResponse({"status": "ok"})

    @app.get("/version")
    async def version() -> dict:
        return {"version": __version__}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    def model_card(name: str) -> dict:
        return {
            "id": name,
            "object": "model",
            "created": created,
            "owned_by": "tokenmill",
            "root": engine.config.model,
            "parent": None,
            "max_model_len": engine.max_model_len,
            # vLLM's card lists one permission, everything a client may do with the model.
            "permission": [
                {
                    "id": f"modelperm-{name}", "object": "model_permission", "created": created,
                    "allow_create_engine": False, "allow_sampling": True, "allow_logprobs": True,
                    "allow_search_indices": False, "allow_view": True, "allow_fine_tuning": False,
                    "organization": "*", "group": None, "is_blocking": False,
                }
            ],
        }  # fmt: skip

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [model_card(name) for name in state.served_model_names]}

    @app.get("/v1/models/{model_id:path}")
    async def retrieve_model(model_id: str) -> dict:
        # Served names may hold slashes (org/model): the whole rest of the path is the id.
        return model_card(state.check_model(model_id))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: ChatCompletionRequest, raw_request: Request) -> Response:
        return await chat.create(request, raw_request)

    @app.post("/v1/completions")
    async def completions(request: CompletionRequest, raw_request: Request) -> Response:
        return await completion.create(request, raw_request)

    @app.post("/v1/embeddings")
    async def embeddings(request: EmbeddingRequest, raw_request: Request) -> Response:
        return await embedding.create(request, raw_request)

    @app.post("/tokenize")
    async def tokenize(request: TokenizeRequest) -> dict:
        state.check_model(request.model)
        tokenizer = engine.tokenizer
        if tokenizer is None:
            raise bad_request("this server runs with --skip-tokenizer-init and has no tokenizer.")
        if request.messages is not None:
            render = functools.partial(
                render_chat, tokenizer, request.messages, request.add_generation_prompt, request.tools,
                state.encode_chat if request.chat_template is None else None, request.continue_final_message,
                request.chat_template, request.chat_template_kwargs,
            )  # fmt: skip
        else:
            render = functools.partial(
                render_prompt, tokenizer, request.prompt, add_special_tokens=request.add_special_tokens
            )
        _, token_ids = await state.off_loop(render)
        token_strs = tokenizer.convert_ids_to_tokens(token_ids) if request.return_token_strs else None
        return {
            "count": len(token_ids), "max_model_len": engine.max_model_len, "tokens": token_ids,
            "token_strs": token_strs,
        }  # fmt: skip

    @app.post("/detokenize")
    async def detokenize(request: DetokenizeRequest) -> dict:
        state.check_model(request.model)
        if engine.tokenizer is None:
            raise bad_request("this server runs with --skip-tokenizer-init and has no tokenizer.")
        bad = [t for t in request.tokens if not 0 <= t < engine.vocab_size]
        if bad:
            raise bad_request(
                f"token ids must be in [0, {engine.vocab_size}), got {bad[:5]}.", param="tokens"
            )
        return {"prompt": await state.off_loop(engine.tokenizer.decode, request.tokens)}

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache() -> dict:
        return {"reset": await engine.reset_prefix_cache()}

    return app


class _Server(uvicorn.Server):
    """uvicorn with tokenmill's shutdown rules instead of its own signal handling."""

    def __init__(self, config: uvicorn.Config, state: ServerState, shutdown_timeout: float) -> None:
        super().__init__(config)
        self.state = state
        self.shutdown_timeout = shutdown_timeout
        self.exit_code = 0
        self._drain_task: asyncio.Task | None = None

    @contextlib.contextmanager
    def capture_signals(self):
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._on_signal, sig)
        try:
            yield
        finally:
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.remove_signal_handler(sig)

    def _on_signal(self, sig: signal.Signals) -> None:
        engine = self.state.engine
        if self._drain_task is None:
            logger.info(
                "%s: draining %d open requests (at most %.0f s)",
                sig.name,
                engine.num_open_requests,
                self.shutdown_timeout,
            )
            self._drain_task = asyncio.get_running_loop().create_task(self._drain())
        elif sig == signal.SIGINT:
            logger.warning("second interrupt: aborting %d open requests", engine.num_open_requests)
            engine.abort_all()
            self.should_exit = True

    async def _drain(self) -> None:
        self.state.draining = True
        engine = self.state.engine
        deadline = time.monotonic() + self.shutdown_timeout
        while engine.num_open_requests and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if engine.num_open_requests:
            logger.warning("drain timeout: aborting %d open requests", engine.num_open_requests)
            engine.abort_all()
        self.should_exit = True

    def on_engine_dead(self) -> None:
        self.exit_code = 1
        asyncio.get_running_loop().call_later(_DEATH_LINGER_S, setattr, self, "should_exit", True)


def _bind(host: str, port: int, reuse_port: bool = False) -> socket.socket:
    """The server's socket, bound (uvicorn makes it listen). With several API processes each binds its own
    with SO_REUSEPORT, and the kernel spreads new connections evenly over those that listen."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuse_port:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise ValueError(f"cannot listen on {host}:{port}: {exc.strerror}; pick another --port.") from exc
    sock.set_inheritable(True)
    return sock


@dataclasses.dataclass(frozen=True)
class AttachTo:
    """What one of several API processes needs to join the engine core its launcher started."""

    index: int
    count: int
    input_address: str
    output_address: str
    core_pid: int


async def _serve(args: argparse.Namespace, sock: socket.socket, attach: AttachTo | None = None) -> int:
    config = engine_config_from_args(args)
    # Bad values fail here, before the model loads.
    default_sampling = default_sampling_params(config)
    chat_template = load_chat_template(args.chat_template) if getattr(args, "chat_template", None) else None
    names = args.served_model_name or [args.model]
    metrics = ServerMetrics(names[0])
    if attach is None:
        engine = await AsyncEngineClient.start(config, metrics)
    else:
        if config.max_waiting_requests is not None:  # the cap is the server's: each process takes its share
            share = -(-config.max_waiting_requests // attach.count)
            config = dataclasses.replace(config, max_waiting_requests=share)
        engine = await AsyncEngineClient.attach(
            config, metrics, attach.input_address, attach.output_address, attach.index, attach.core_pid
        )
    try:  # refusals that need the tokenizer: the core, started, goes with them (else exit waits for it)
        metrics.record_cache_config(config.block_size, engine.num_kv_blocks, config.enable_prefix_caching)
        if chat_template is not None:
            if engine.tokenizer is None:
                raise ValueError("--chat-template needs a tokenizer: drop --skip-tokenizer-init")
            engine.tokenizer.chat_template = chat_template  # this process's tokenizer: chat and /tokenize
        check_reasoning_tokens(getattr(args, "reasoning_parser", None), engine.tokenizer)
    except BaseException:
        await engine.shutdown(timeout=_STOP_S)
        raise
    # What start-up built (modules, the tokenizer) lives as long as the server: frozen, the collector
    # stops walking it, both in the pauses it takes while streams run and in the final collection at exit.
    freeze_startup()
    pauses = GCPauses(f"API process {attach.index if attach else 0}", log_over_s=SERVER_LOG_OVER_S).install()
    try:
        state = ServerState(
            engine, names, metrics, api_key=args.api_key,
            tool_call_parser=getattr(args, "tool_call_parser", None),
            enable_auto_tool_choice=getattr(args, "enable_auto_tool_choice", False),
            reasoning_parser=getattr(args, "reasoning_parser", None),
            default_sampling=default_sampling,
            response_role=getattr(args, "response_role", "assistant"),
            log_requests=getattr(args, "enable_log_requests", False),
            **_disaggregation(args, config),
        )  # fmt: skip
        cors = {
            "allow_origins": getattr(args, "allowed_origins", ["*"]),
            "allow_methods": getattr(args, "allowed_methods", ["*"]),
            "allow_headers": getattr(args, "allowed_headers", ["*"]),
            "allow_credentials": getattr(args, "allow_credentials", False),
        }
        uvicorn_config = uvicorn.Config(
            build_app(state, args.max_request_body_bytes, getattr(args, "root_path", ""), cors),
            log_level=getattr(args, "uvicorn_log_level", None) or args.log_level,
            access_log=args.access_log,
            lifespan="off",
            timeout_keep_alive=5,
            timeout_graceful_shutdown=_STOP_S,
        )
        server = _Server(uvicorn_config, state, args.shutdown_timeout)
        engine.add_dead_callback(server.on_engine_dead)
        host, port = sock.getsockname()[:2]
        if attach is None or attach.index == 0:
            logger.info(
                "serving %s on http://%s:%d (max_model_len=%d, %d KV blocks%s)",
                names[0], host, port, engine.max_model_len, engine.num_kv_blocks,
                "" if attach is None else f", {attach.count} API processes",
            )  # fmt: skip
            if default_sampling:
                logger.info(describe(default_sampling))
        await server.serve(sockets=[sock])
        return server.exit_code
    finally:
        pauses.uninstall()
        await engine.shutdown(timeout=_STOP_S)


def load_chat_template(value: str) -> str:
    """--chat-template as vLLM reads it: the template itself when it holds Jinja's characters, else a file."""
    if any(char in value for char in "{}\n"):
        return value
    try:
        with open(value) as file:
            return file.read()
    except OSError as exc:
        raise ValueError(
            f"--chat-template {value!r} looks like a file path, but it cannot be read ({exc.strerror})"
        ) from None


def _disaggregation(args: argparse.Namespace, config) -> dict:
    """ServerState's part in prefill/decode disaggregation (entrypoints/openai/disagg.py)."""
    if config.kv_role == "prefill":
        return {"kv_address": kv_address(args.host, config.kv_port)}
    if config.kv_role == "decode":
        peers = [p for arg in getattr(args, "kv_peer", None) or [] for p in arg.split(",") if p]
        return {
            "prefill_peers": PrefillPeers(peers, args.remote_prefill_min_tokens, config.kv_transfer_timeout)
        }
    return {}


def _configure_logging(level: str, process_name: str = "") -> None:
    logging.basicConfig(
        level=level.upper(), format=f"%(asctime)s %(levelname)s %(name)s{process_name}: %(message)s"
    )


def run_server(args: argparse.Namespace) -> int:
    _configure_logging(args.log_level)
    # Bind first: a taken port fails in a moment, not after the model has loaded.
    sock = _bind(args.host, args.port, reuse_port=args.api_server_count > 1)
    if args.api_server_count > 1:
        from .launcher import run_api_servers

        return run_api_servers(args, sock)
    return uvloop.run(_serve(args, sock))


def run_api_process(args: argparse.Namespace, port: int, attach: AttachTo) -> None:
    """Entry point of one of several API processes, spawned by the launcher. Each listens on its own
    SO_REUSEPORT socket: one shared listening socket would let whichever process wakes first accept a
    whole burst of connections."""
    _configure_logging(args.log_level, f"[api{attach.index}]")
    try:
        sock = _bind(args.host, port, reuse_port=True)
        code = uvloop.run(_serve(args, sock, attach))
    except ValueError as exc:
        # A bad configuration reaches every API process alike; one of them says so.
        if attach.index == 0:
            print(f"error: {exc}", file=sys.stderr)
        code = 2
    sys.exit(code)
