"""An API process's link to the engine-core process: its pair of ZMQ sockets, the core's start (or a watch
on its life when another process started it), the wait for its EngineReady, and the errors a request
can meet through the link."""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import select
import shutil
import tempfile
from dataclasses import dataclass

import zmq
import zmq.asyncio

from tokenmill.config import EngineConfig
from tokenmill.core.outputs import GRAMMAR_FAILED
from tokenmill.loader import resolve_model
from tokenmill.serving.core_process import run_engine_core
from tokenmill.serving.core_protocol import EngineDead, EngineReady, message_decoder

_READY_POLL_MS = 200
logger = logging.getLogger("tokenmill.server")


class EngineDeadError(RuntimeError):
    """The engine-core process has died; no request can complete."""


class EngineStartError(RuntimeError):
    """The engine core failed to start for a reason other than a bad configuration (out of device memory,
    a driver error); the core's own log has its traceback."""


class RequestFailedError(RuntimeError):
    """The core ended the request as failed (EngineCoreOutput.error): its grammar failed mid-answer."""


class KVTransferError(RequestFailedError):
    """Disaggregation: the request's KV never came from its prefill peer (the core ended it)."""


def request_failure(error: str) -> RequestFailedError:
    """The exception a failed request's stream raises, by what its EngineCoreOutput.error says."""
    return RequestFailedError(error) if error.startswith(GRAMMAR_FAILED) else KVTransferError(error)


class EngineOverloadedError(RuntimeError):
    """The waiting queue is at its cap (EngineConfig.max_waiting_requests)."""


class CoreSockets:
    """An API process's two ZMQ sockets, bound on ipc:// paths: requests out, outputs in."""

    def __init__(self, input_address: str, output_address: str, directory: str | None = None) -> None:
        self.directory = directory  # removed on close: the private directory `bind` made
        self.input_address = input_address
        self.output_address = output_address
        self._sync_context = zmq.Context()
        self._async_context = zmq.asyncio.Context()
        self.input = self._sync_context.socket(zmq.PUSH)
        self.input.setsockopt(zmq.SNDHWM, 0)  # requests are small; never drop or stall on a burst
        self.input.bind(input_address)
        self.output = self._async_context.socket(zmq.PULL)
        self.output.setsockopt(zmq.RCVHWM, 0)
        self.output.bind(output_address)

    @classmethod
    def bind(cls) -> CoreSockets:
        directory = tempfile.mkdtemp(prefix="tokenmill-")
        return cls(f"ipc://{directory}/input", f"ipc://{directory}/output", directory)

    def close(self) -> None:
        self.input.close(linger=0)
        self.output.close(linger=0)
        self._sync_context.term()
        self._async_context.term()
        if self.directory is not None:
            shutil.rmtree(self.directory, ignore_errors=True)


class CoreWatch:
    """The engine core seen from an API process that did not start it: a pidfd (readable once the process
    has exited) stands in for multiprocessing's sentinel. The exit code belongs to its parent."""

    exitcode = None

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.sentinel = os.pidfd_open(pid)

    def is_alive(self) -> bool:
        return not select.select([self.sentinel], [], [], 0)[0]

    def join(self, timeout: float | None = None) -> None:
        select.select([self.sentinel], [], [], timeout)

    def close(self) -> None:
        os.close(self.sentinel)


async def wait_ready(
    sockets: CoreSockets, process: multiprocessing.process.BaseProcess | CoreWatch
) -> EngineReady:
    """The core's EngineReady, once its model is loaded and both sockets are connected; its start-up
    error as a ValueError (a bad configuration) or an EngineStartError."""
    decoder = message_decoder()
    while True:
        if await sockets.output.poll(_READY_POLL_MS):
            message = decoder.decode(await sockets.output.recv())
            if isinstance(message, EngineReady):
                break
            if isinstance(message, EngineDead):
                error_class = ValueError if message.error_type == "ValueError" else EngineStartError
                raise error_class(message.error)
        elif not process.is_alive():
            raise EngineStartError(
                f"engine core process exited with code {process.exitcode} before it was ready."
            )
    # The core connected to these sockets when it started, and retries every 100 ms where one was not
    # bound yet: its outputs reach us now, but the input side may still be connecting, and a request
    # sent before it would find no peer.
    while not sockets.input.poll(0, zmq.POLLOUT):
        if not process.is_alive():
            raise RuntimeError("engine core process exited before it connected.")
        await asyncio.sleep(0.01)
    return message


def spawn_core(config: EngineConfig, sockets: CoreSockets) -> multiprocessing.process.BaseProcess:
    """Start the engine-core process, which connects to these sockets."""
    process = multiprocessing.get_context("spawn").Process(
        target=run_engine_core,
        args=(config, [sockets.input_address], [sockets.output_address]),
        name="tokenmill-engine-core",
        daemon=True,
    )
    process.start()
    logger.info("engine core process started (pid %d)", process.pid)
    return process


@dataclass
class CoreLink:
    """What an API process learns while the core loads: the core's EngineReady, and the tokenizer."""

    ready: EngineReady
    tokenizer: object
    eos_token_ids: tuple[int, ...]
    hf_config: object


async def connect(
    config: EngineConfig, sockets: CoreSockets, process: multiprocessing.process.BaseProcess | CoreWatch
) -> CoreLink:
    """Load the tokenizer while the core loads the model (a bad model path fails here first), then wait
    for the core; the sockets are closed if either fails."""
    try:
        model, load_format = config.model, config.load_format
        source = await asyncio.to_thread(resolve_model, model, load_format, config.tokenizer)
        tokenizer = None if config.skip_tokenizer_init else await asyncio.to_thread(source.load_tokenizer)
        ready = await wait_ready(sockets, process)
    except BaseException:
        sockets.close()
        raise
    return CoreLink(ready, tokenizer, source.eos_token_ids(tokenizer), source.hf_config)
