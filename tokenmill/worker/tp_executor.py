"""Tensor parallelism: one process per rank, each with its own ModelRunner over its shard of the weights
and of the KV heads. Rank 0 lives in the engine core's process and is the core's executor: each step's
record goes to every other rank before rank 0 runs it, and every rank runs the same forward (the layers'
all-reduces and the LM head's all-gather meet in torch.distributed: NCCL on GPUs, gloo on CPUs) and
samples the same tokens from the same gathered logits (a step under grammars gets rank 0's masks too);
only rank 0's tokens go back to the scheduler.

The other ranks are plain subprocesses (`python -m tokenmill.worker.tp_executor`), so a daemonic engine
core process can start them; they take their orders over a multiprocessing connection and exit when it
closes.
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
import subprocess
import sys
import weakref
from multiprocessing.connection import Client, Connection, Listener

import numpy as np
import torch

from tokenmill import distributed

logger = logging.getLogger("tokenmill")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


class _MasksToAll:
    """A launched step under grammars on rank 0: its masks go to every rank before it samples."""

    def __init__(self, launched, conns: list[Connection]) -> None:
        self.launched, self.conns = launched, conns

    def with_grammar(self, grammar_bitmask: np.ndarray):
        for conn in self.conns:
            conn.send(("masks", grammar_bitmask))
        return self.launched.with_grammar(grammar_bitmask)


class TensorParallelExecutor:
    """Rank 0's side: the engine core's executor, and the channel to the other ranks."""

    def __init__(self, runner, conns: list[Connection], processes: list[subprocess.Popen]) -> None:
        self.runner, self.conns, self.processes = runner, conns, processes
        self._finalizer = weakref.finalize(self, _stop, conns, processes)

    def broadcast(self, op: str, arg=None) -> None:
        for conn in self.conns:
            conn.send((op, arg))

    def execute(self, scheduler_output):
        self.broadcast("execute", scheduler_output)
        launched = self.runner.execute(scheduler_output)
        if scheduler_output.grammar_req_ids:
            return _MasksToAll(launched, self.conns)
        return launched

    def shutdown(self) -> None:
        self._finalizer()


def _stop(conns: list[Connection], processes: list[subprocess.Popen]) -> None:
    for conn in conns:
        try:
            conn.send(("stop", None))
            conn.close()
        except OSError:
            pass
    distributed.destroy()  # this process may build another engine afterwards
    for process in processes:
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()


def start_ranks(
    config, size: int, device: torch.device
) -> tuple[list[Connection], list[subprocess.Popen], str]:
    """Start ranks 1..size-1 and join the group as rank 0: (their connections, processes, init method)."""
    authkey = secrets.token_bytes(16)
    listener = Listener(("127.0.0.1", 0), authkey=authkey)
    init_method = f"tcp://127.0.0.1:{_free_port()}"
    env = {**os.environ, "NCCL_NVLS_ENABLE": "0"}
    processes = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tokenmill.worker.tp_executor",
                f"{listener.address[0]}:{listener.address[1]}",
                authkey.hex(),
                str(rank),
            ],
            env=env,
        )  # fmt: skip
        for rank in range(1, size)
    ]
    conns: list[Connection | None] = [None] * (size - 1)
    for _ in range(size - 1):
        conn = listener.accept()
        rank = conn.recv()
        conns[rank - 1] = conn
    listener.close()
    for conn in conns:
        assert conn is not None
        conn.send((config, size, init_method))
    distributed.init_tensor_parallel(size, 0, init_method, backend_for(device))
    return [c for c in conns if c is not None], processes, init_method


def _serve(address: str, authkey: bytes, rank: int) -> None:
    """Rank `rank`'s loop: build the runner as rank 0 asks, then run each step it sends."""
    from tokenmill.loader import resolve_model
    from tokenmill.worker.model_runner import ModelRunner

    host, port = address.rsplit(":", 1)
    conn = Client((host, int(port)), authkey=authkey)
    conn.send(rank)
    config, size, init_method = conn.recv()
    device = (
        torch.device("cuda", rank)
        if torch.cuda.is_available() and config.device in ("auto", "cuda")
        else None
    )
    if device is not None:
        torch.cuda.set_device(device)
    distributed.init_tensor_parallel(size, rank, init_method, "nccl" if device is not None else "gloo")
    runner = None
    in_flight = None  # the step before the last launched: its tokens are waited for after the next launch
    try:
        while True:
            op, arg = conn.recv()
            if op == "build":
                source = resolve_model(config.model, config.load_format, config.tokenizer)
                max_model_len, pooling_type = arg
                runner = ModelRunner(config, source, max_model_len, pooling_type)
            elif op == "num_blocks":
                from tokenmill.serving.engine_setup import _num_kv_blocks

                distributed.all_reduce_min(_num_kv_blocks(config, runner, arg))
            elif op == "allocate":
                runner.allocate_kv_cache(arg)
            elif op == "capture":
                runner.capture_cuda_graphs(arg)
            elif op == "execute":
                # As rank 0 does with async scheduling: launch this step, then wait for the one before.
                launched = runner.execute(arg)
                if arg.grammar_req_ids:
                    tag, masks = conn.recv()
                    assert tag == "masks", tag
                    launched = launched.with_grammar(masks)
                if in_flight is not None:
                    in_flight.result()
                in_flight = launched
            elif op == "stop":
                break
    except EOFError:  # rank 0 is gone
        pass
    # Nothing to keep: skip the interpreter's teardown of torch and the group (seconds).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING)
    _serve(sys.argv[1], bytes.fromhex(sys.argv[2]), int(sys.argv[3]))
