"""`tokenmill router`: run the router in front of replicas; `tokenmill router simulate`: compare the
policies on a simulated fleet."""

from __future__ import annotations

import argparse
import logging

import uvloop

from tokenmill.router.policy import POLICIES

logger = logging.getLogger("tokenmill.router")


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "router",
        help="route OpenAI requests over replicas, where their prompt prefix is cached",
        description="An OpenAI-compatible proxy over several replicas (tokenmill serve, or any "
        "OpenAI-compatible server). The cache_aware policy sends a request to the replica that holds "
        "the longest prefix of its prompt unless that replica is overloaded.",
    )
    add_router_arguments(parser)
    parser.set_defaults(func=_run)
    commands = parser.add_subparsers(dest="router_command")
    simulate = commands.add_parser(
        "simulate",
        help="compare routing policies on a simulated fleet, with the planner's step-time model",
    )
    try:
        from tokenmill.router.simulate import add_simulate_arguments, simulate_main
    except ModuleNotFoundError:
        return
    add_simulate_arguments(simulate)
    simulate.set_defaults(func=simulate_main)


def add_router_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8080, help="port to listen on (default: 8080)")
    parser.add_argument(
        "--backend", action="append", default=[], metavar="URL",
        help="a replica's base URL, e.g. http://10.0.0.5:8000 (repeat for each)",
    )  # fmt: skip
    parser.add_argument(
        "--discover", action="append", default=[], metavar="HOST:PORT",
        help="a DNS name whose addresses are replicas (e.g. a Kubernetes headless Service), re-resolved "
        "at every health check",
    )  # fmt: skip
    parser.add_argument("--policy", default="cache_aware", choices=POLICIES)
    parser.add_argument(
        "--balance-threshold", type=float, default=16,
        help="cache_aware: requests in hand by which the replica holding the prefix may exceed the least "
        "loaded one before the request goes to the least loaded instead (default: 16)",
    )  # fmt: skip
    parser.add_argument(
        "--model", default=None,
        help="the served model ('default', a HF directory or .gguf), whose tokenizer and chat template "
        "the router hashes prompts with, as the engine does; without it prompts are hashed as text",
    )  # fmt: skip
    parser.add_argument("--tokenizer", default=None, help="a tokenizer to use instead of the model's")
    parser.add_argument(
        "--block-size", type=int, default=None,
        help="tokens per KV block to hash prompts in (default: what the replicas report, else 16)",
    )  # fmt: skip
    parser.add_argument("--health-interval", type=float, default=2.0, help="seconds between health checks")
    parser.add_argument("--health-timeout", type=float, default=5.0, help="seconds a replica has to answer")
    parser.add_argument("--seed", type=int, default=None, help="seed of the random policy")
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])


def build_router(args: argparse.Namespace):
    """The Router the arguments describe (a bad one is a ValueError naming the option)."""
    from tokenmill.router.index import PrefixIndex
    from tokenmill.router.policy import make_policy
    from tokenmill.router.prefix import PromptHasher
    from tokenmill.router.proxy import Router
    from tokenmill.router.replicas import ReplicaSet

    if args.health_interval <= 0 or args.health_timeout <= 0:
        raise ValueError("--health-interval and --health-timeout must be > 0")
    tokenizer = None
    source = args.tokenizer or args.model
    if source:
        from tokenmill.loader import resolve_model

        resolved = resolve_model(source)
        tokenizer = resolved.load_tokenizer()
    replicas = ReplicaSet(args.backend, args.discover, args.health_interval, args.health_timeout)
    policy = make_policy(args.policy, args.balance_threshold, args.seed)
    return Router(replicas, policy, PromptHasher(tokenizer, args.block_size), PrefixIndex())


def _run(args: argparse.Namespace) -> int:
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    router = build_router(args)
    return uvloop.run(serve_router(router, args.host, args.port, args.log_level))


async def serve_router(
    router, host: str, port: int, log_level: str = "info", sock=None, server_class=None
) -> int:
    """Serve until SIGINT/SIGTERM (uvicorn's handlers; server_class, a uvicorn.Server of the caller's, may
    handle them its own way)."""
    import uvicorn

    from tokenmill.router.proxy import build_app

    await router.start()
    try:
        healthy = len(router.replicas.healthy())
        logger.info(
            "routing with %s over %d replicas (%d healthy) on http://%s:%d",
            router.policy.name, len(router.replicas.replicas), healthy, host, port,
        )  # fmt: skip
        config = uvicorn.Config(
            build_app(router), host=host, port=port, log_level=log_level, access_log=False,
            lifespan="off", timeout_keep_alive=5, timeout_graceful_shutdown=5,
        )  # fmt: skip
        server = (server_class or uvicorn.Server)(config)
        await server.serve(sockets=[sock] if sock is not None else None)
    finally:
        await router.stop()
    return 0
