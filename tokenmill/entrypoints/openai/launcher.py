"""`tokenmill serve --api-server-count N`: one engine core behind N API processes. At hundreds of streams a
single API process spends a whole core on HTTP, SSE framing and detokenizing while the engine core
waits for it; N processes share that work. This process only launches and supervises: it starts the
core and the N API processes (each listens on the port with SO_REUSEPORT, and the kernel spreads new
connections over them), forwards SIGTERM and SIGINT to them so that they drain, and stops the core once
they are gone. Its own socket, bound and never listening, holds the port meanwhile.

If the engine core dies, the API processes fail their open requests, answer /health 503 for a moment
and exit 1, and so does this process; if an API process dies, the others are told to drain and the
server exits 1."""

from __future__ import annotations

import argparse
import contextlib
import logging
import multiprocessing
import multiprocessing.connection
import os
import shutil
import signal
import socket
import tempfile

import msgspec
import zmq

from tokenmill.entrypoints.engine_args import engine_config_from_args
from tokenmill.serving.core_process import run_engine_core
from tokenmill.serving.core_protocol import Shutdown

from .api_server import _STOP_S, AttachTo, run_api_process

logger = logging.getLogger("tokenmill.server")

_POLL_S = 0.5


def run_api_servers(args: argparse.Namespace, sock: socket.socket) -> int:
    count = args.api_server_count
    port = sock.getsockname()[1]  # the one bound, when --port 0 asked for any
    config = engine_config_from_args(args)  # a bad knob fails here, once, before anything starts
    directory = tempfile.mkdtemp(prefix="tokenmill-")
    # Read by prometheus_client when the API processes import it: their metrics go to files here.
    metrics_dir = os.path.join(directory, "metrics")
    os.mkdir(metrics_dir)
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir
    inputs = [f"ipc://{directory}/input-{i}" for i in range(count)]
    outputs = [f"ipc://{directory}/output-{i}" for i in range(count)]
    context = zmq.Context()
    control = context.socket(zmq.PUSH)  # this process's own line to the core, for Shutdown
    control.bind(f"ipc://{directory}/control")
    spawn = multiprocessing.get_context("spawn")
    core = spawn.Process(
        target=run_engine_core,
        args=(config, [f"ipc://{directory}/control", *inputs], outputs),
        name="tokenmill-engine-core",
        daemon=True,
    )
    api_processes = []
    try:
        core.start()
        logger.info("engine core process started (pid %d); starting %d API processes", core.pid, count)
        for index in range(count):
            attach = AttachTo(index, count, inputs[index], outputs[index], core.pid)
            process = spawn.Process(
                target=run_api_process, args=(args, port, attach), name=f"tokenmill-api-{index}", daemon=True
            )
            process.start()
            api_processes.append(process)
        return _supervise(core, api_processes)
    finally:
        _stop_core(core, control)
        for process in api_processes:
            if process.is_alive():
                process.kill()
            process.join()
        control.close(linger=0)
        context.term()
        sock.close()
        shutil.rmtree(directory, ignore_errors=True)


def _supervise(core: multiprocessing.process.BaseProcess, api_processes: list) -> int:
    """Wait until every API process has exited; returns the server's exit code."""
    stopping = False
    failed = False

    def forward(signum: int, _frame: object) -> None:
        nonlocal stopping
        stopping = True
        _signal_all(api_processes, signal.SIGTERM)

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        running = list(api_processes)
        while running:
            multiprocessing.connection.wait([p.sentinel for p in running] + [core.sentinel], _POLL_S)
            for process in [p for p in running if not p.is_alive()]:
                process.join()
                running.remove(process)
                # Killed by the SIGTERM this process forwarded before it could install its handlers:
                # that is a clean stop too.
                clean = process.exitcode == 0 or (stopping and process.exitcode == -signal.SIGTERM)
                if not clean:
                    failed = True
                    if not stopping and core.is_alive():
                        logger.error(
                            "%s exited with code %s; stopping the server.", process.name, process.exitcode
                        )
                    stopping = True
                    _signal_all(running, signal.SIGTERM)
            if not stopping and not core.is_alive():
                # The API processes see it too and exit 1 after failing their open requests.
                failed = stopping = True
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 1 if failed else 0


def _signal_all(processes: list, signum: int) -> None:
    for process in processes:
        if process.is_alive():
            with contextlib.suppress(ProcessLookupError):
                os.kill(process.pid, signum)


def _stop_core(core: multiprocessing.process.BaseProcess, control: zmq.Socket) -> None:
    if core.pid is None:  # never started
        return
    if core.is_alive():
        with contextlib.suppress(zmq.Again):  # no peer yet: the core was still starting
            control.send(msgspec.msgpack.encode(Shutdown()), zmq.NOBLOCK)
        core.join(_STOP_S)
        if core.is_alive():
            logger.warning("engine core did not stop in %.1f s; killing it", _STOP_S)
            core.kill()
    core.join()
