"""`tokenmill serve --data-parallel-size N`: N replicas of the server, each a whole `tokenmill serve`
(engine core and API process) on a free local port, with the router in this process on --port in
front of them. On a host with N or more GPUs replica i gets the i-th; on a CPU the cores are shared
out. A replica that dies leaves the rotation (the router's health checks) and the others keep serving;
SIGTERM and SIGINT drain every replica, then stop the router."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import copy
import logging
import multiprocessing
import multiprocessing.connection
import os
import signal
import socket
import threading
import time

import uvloop

logger = logging.getLogger("tokenmill.server")


def run_data_parallel(args: argparse.Namespace) -> int:
    from tokenmill.entrypoints.engine_args import engine_config_from_args
    from tokenmill.entrypoints.openai.api_server import _bind, _configure_logging
    from tokenmill.router.index import PrefixIndex
    from tokenmill.router.policy import make_policy
    from tokenmill.router.prefix import PromptHasher
    from tokenmill.router.proxy import Router
    from tokenmill.router.replicas import ReplicaSet

    _configure_logging(args.log_level, "[router]")
    if args.api_server_count > 1:
        raise ValueError("--data-parallel-size runs one API process per replica; drop --api-server-count")
    config = engine_config_from_args(args)  # a bad knob fails here, once, before anything starts
    sock = _bind(args.host, args.port)  # a taken port fails now, not after N models have loaded
    count = args.data_parallel_size
    ports = [_free_port() for _ in range(count)]
    devices = _device_shares(config.device, count)
    spawn = multiprocessing.get_context("spawn")
    replicas = []
    for index, port in enumerate(ports):
        replica_args = copy.copy(args)
        replica_args.host, replica_args.port, replica_args.data_parallel_size = "127.0.0.1", port, 1
        replica_args.access_log = False  # the router's health checks would fill it
        process = spawn.Process(
            target=_replica_main,
            args=(replica_args, index, devices[index]),
            name=f"tokenmill-replica-{index}",
        )
        process.start()
        replicas.append(process)
    logger.info("started %d replicas on ports %s", count, ", ".join(map(str, ports)))
    try:
        tokenizer = None
        if not config.skip_tokenizer_init:
            from tokenmill.loader import resolve_model

            tokenizer = resolve_model(config.tokenizer or config.model).load_tokenizer()
        router = Router(
            ReplicaSet([f"http://127.0.0.1:{port}" for port in ports], [], interval_s=1.0),
            make_policy(args.router_policy),
            PromptHasher(tokenizer, config.block_size),
            PrefixIndex(),
        )
        return uvloop.run(_serve(router, args, sock, replicas))
    finally:
        for process in replicas:
            if process.is_alive():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(process.pid, signal.SIGTERM)
        deadline = time.monotonic() + args.shutdown_timeout + 10
        for process in replicas:  # they drain in parallel; the deadline is for all of them
            process.join(max(0.0, deadline - time.monotonic()))
            if process.is_alive():
                process.kill()
                process.join()


async def _serve(router, args: argparse.Namespace, sock: socket.socket, replicas: list) -> int:
    import uvicorn

    from tokenmill.router.cli import serve_router

    class DrainingServer(uvicorn.Server):
        """The router's server: the first SIGTERM or SIGINT drains the replicas (each finishes its running
        requests within --shutdown-timeout, answering new ones 503 draining) while the router keeps
        passing their streams through, and stops the router once every replica is gone; a second signal
        stops it at once."""

        draining = False

        def handle_exit(self, sig, frame) -> None:
            if self.draining:
                super().handle_exit(sig, frame)
                return
            self.draining = True
            logger.info("draining %d replicas before the router stops", len(replicas))
            for process in replicas:
                if process.is_alive():
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(process.pid, signal.SIGTERM)
            threading.Thread(target=self._stop_when_drained, name="tokenmill-drain", daemon=True).start()

        def _stop_when_drained(self) -> None:
            deadline = time.monotonic() + args.shutdown_timeout + 10
            while time.monotonic() < deadline and any(p.exitcode is None for p in replicas):
                time.sleep(0.1)
            self.should_exit = True

    watch = asyncio.create_task(_watch_replicas(replicas))
    try:
        await serve_router(
            router, args.host, args.port, args.log_level, sock=sock, server_class=DrainingServer
        )
    finally:
        watch.cancel()
    return 0 if all(p.exitcode in (None, 0) for p in replicas) else 1


async def _watch_replicas(replicas: list) -> None:
    reported = set()
    while True:
        await asyncio.sleep(1.0)
        for process in replicas:
            if process.exitcode is not None and process.name not in reported:
                reported.add(process.name)
                logger.error(
                    "%s exited with code %s; serving with the others", process.name, process.exitcode
                )


def _replica_main(args: argparse.Namespace, index: int, device: dict[str, str]) -> None:
    os.environ.update(device)  # before torch is imported in this process
    from tokenmill.entrypoints.openai.api_server import _configure_logging, run_server

    _configure_logging(args.log_level, f"[replica{index}]")
    # A launcher that dies without stopping its replicas (SIGKILL) must not leave them serving: each
    # drains and exits when its parent is gone, as on SIGTERM.
    parent = multiprocessing.parent_process()
    if parent is not None:
        threading.Thread(target=_exit_with, args=(parent.sentinel,), daemon=True).start()
    raise SystemExit(run_server(args))


def _exit_with(sentinel: int) -> None:
    multiprocessing.connection.wait([sentinel])
    os.kill(os.getpid(), signal.SIGTERM)


def _device_shares(device: str, count: int) -> list[dict[str, str]]:
    """Environment for each replica: its own GPU when the host has enough, else a share of the CPU's
    threads (N engines each taking every core would fight over them)."""
    import torch

    if device != "cpu" and torch.cuda.is_available():
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        ids = visible.split(",") if visible else [str(i) for i in range(torch.cuda.device_count())]
        if len(ids) < count:
            raise ValueError(
                f"--data-parallel-size {count} needs {count} GPUs, {len(ids)} visible; lower it or use "
                "--device cpu"
            )
        return [{"CUDA_VISIBLE_DEVICES": ids[i]} for i in range(count)]
    threads = os.environ.get("OMP_NUM_THREADS") or str(max(1, (os.cpu_count() or 1) // count))
    return [{"OMP_NUM_THREADS": threads} for _ in range(count)]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
