"""Tensor parallelism: one process per rank, each with its own ModelRunner over its shard of the weights
and of the KV heads. Rank 0 lives in the engine core's process and is the core's executor: each step's
record goes to every other rank before rank 0 runs it, and every rank runs the same forward (the layers'
all-reduces and the LM head's all-gather meet in torch.distributed: NCCL on GPUs, gloo on CPUs) and
samples the same tokens from the same gathered logits (a step under grammars gets rank 0's masks too);
only rank 0's tokens go back to the scheduler.

The other ranks are RankWorkers, reached one of two ways (distributed_executor_backend):
- "mp": subprocesses on this machine (`python -m tokenmill.worker.tp_executor`, so a daemonic engine
  core process can start them), taking their orders over a multiprocessing connection; they exit when
  it closes.
- "ray": Ray actors, one per rank in a placement group (one GPU each), on any node of the Ray cluster
  this process joins (RAY_ADDRESS, or a local one), as vLLM users run multi-node.
"""

from __future__ import annotations

import logging
import os
import pickle
import secrets
import socket
import subprocess
import sys
import traceback
import weakref
from multiprocessing.connection import Client, Connection, Listener

import numpy as np
import torch

from tokenmill import distributed

logger = logging.getLogger("tokenmill")

_NCCL_ENV = {"NCCL_NVLS_ENABLE": "0"}  # NVLink multicast stays off on these machines


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def expert_dispatch(config) -> str | None:
    """How MoE layers reach their experts under expert parallelism; None without it."""
    return config.expert_dispatch if config.enable_expert_parallel else None


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


class RankWorker:
    """Ranks 1..N-1: one method per order of rank 0, called in the order rank 0 gives them."""

    def __init__(self, config, size: int, rank: int, init_method: str, cuda_index: int | None) -> None:
        if cuda_index is not None:
            torch.cuda.set_device(cuda_index)
        backend = "nccl" if cuda_index is not None else "gloo"
        distributed.init_tensor_parallel(size, rank, init_method, backend, expert_dispatch(config))
        self.config = config
        self.runner = None
        self.awaiting = None  # a launched step under grammars, until its masks come
        self.in_flight = None  # the step before the last launched: waited for after the next launch

    def build(self, max_model_len: int, pooling_type: str | None) -> None:
        from tokenmill.loader import resolve_model
        from tokenmill.worker.model_runner import ModelRunner

        config = self.config
        source = resolve_model(config.model, config.load_format, config.tokenizer)
        self.runner = ModelRunner(config, source, max_model_len, pooling_type)

    def num_blocks(self, batched_tokens: int) -> None:
        from tokenmill.serving.engine_setup import _num_kv_blocks

        distributed.all_reduce_min(_num_kv_blocks(self.config, self.runner, batched_tokens))

    def allocate(self, num_blocks: int) -> None:
        self.runner.allocate_kv_cache(num_blocks)

    def allocate_host(self, num_blocks: int, disk_dir: str | None = None, num_disk_blocks: int = 0) -> None:
        self.runner.allocate_host_kv_cache(num_blocks, disk_dir, num_disk_blocks)

    def capture(self, batched_tokens: int) -> None:
        self.runner.capture_cuda_graphs(batched_tokens)

    def execute(self, scheduler_output) -> None:
        launched = self.runner.execute(scheduler_output)
        if scheduler_output.grammar_req_ids:
            self.awaiting = launched
        else:
            self._launched(launched)

    def masks(self, grammar_bitmask: np.ndarray) -> None:
        self._launched(self.awaiting.with_grammar(grammar_bitmask))
        self.awaiting = None

    def _launched(self, pending) -> None:
        # As rank 0 does with async scheduling: launch this step, then wait for the one before. A step
        # that speculates is waited for at once, as rank 0 does: its drafter's forward passes (a draft
        # model, layer skip) meet rank 0's in their collectives.
        if self.in_flight is not None:
            self.in_flight.result()
            self.in_flight = None
        if getattr(pending, "propose_drafts", False):
            pending.result()
        else:
            self.in_flight = pending


class RankDiedError(RuntimeError):
    """Another tensor-parallel rank is gone: the engine cannot run a step without it."""


class _MasksToAll:
    """A launched step under grammars on rank 0: its masks go to every rank before it samples."""

    def __init__(self, launched, executor: TensorParallelExecutor) -> None:
        self.launched, self.executor = launched, executor

    def with_grammar(self, grammar_bitmask: np.ndarray):
        self.executor.broadcast("masks", grammar_bitmask)
        return self.launched.with_grammar(grammar_bitmask)

    def host_masks(self, words: int) -> None:
        """The other ranks get the masks as an array: rank 0 waits for them on the host."""
        return None


class TensorParallelExecutor:
    """Rank 0's side: the engine core's executor, and the channel to the other ranks."""

    def __init__(self, runner, ranks: _Ranks) -> None:
        self.runner, self.ranks = runner, ranks
        self._finalizer = weakref.finalize(self, ranks.stop)

    def broadcast(self, op: str, *args) -> None:
        self.ranks.send(op, *args)

    def prepare(self, scheduler_output):
        """Rank 0's host half; the other ranks get the step at launch, after any masks of the step
        before it (they run both halves at once, in the order their orders come)."""
        return self.runner.prepare(scheduler_output)

    def launch(self, prepared):
        scheduler_output = prepared.scheduler_output
        self.broadcast("execute", scheduler_output)
        launched = self.runner.launch(prepared)
        if scheduler_output.grammar_req_ids:
            return _MasksToAll(launched, self)
        return launched

    def shutdown(self) -> None:
        self._finalizer()


class _Ranks:
    def send(self, op: str, *args) -> None:
        raise NotImplementedError

    def stop(self) -> None:
        raise NotImplementedError


class _Subprocesses(_Ranks):
    def __init__(self, conns: list[Connection], processes: list[subprocess.Popen]) -> None:
        self.conns, self.processes = conns, processes
        self.stopped = False

    def send(self, op: str, *args) -> None:
        # A rank that died would leave the others waiting in their next collective: fail instead.
        for rank, process in enumerate(self.processes, start=1):
            if process.poll() is not None:
                raise RankDiedError(f"tensor-parallel rank {rank} exited (code {process.returncode}).")
        message = pickle.dumps((op, args))  # once per step, not once per rank
        try:
            for conn in self.conns:
                conn.send_bytes(message)
        except OSError as exc:
            raise RankDiedError(f"a tensor-parallel rank is gone ({exc}).") from None

    def stop(self) -> None:
        if self.stopped:  # a failed start stops the ranks, and the executor's finalizer again
            return
        self.stopped = True
        for conn in self.conns:
            try:
                conn.send_bytes(pickle.dumps(("stop", ())))
                conn.close()
            except OSError:
                pass
        distributed.destroy()  # this process may build another engine afterwards
        for process in self.processes:
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()


class _RayActors(_Ranks):
    def __init__(self, actors: list, placement) -> None:
        self.actors, self.placement = actors, placement
        self.pending: list = []  # calls not yet seen to finish: an actor's error surfaces at the next send
        self.stopped = False

    def send(self, op: str, *args) -> None:
        import ray

        self.pending += [getattr(actor, op).remote(*args) for actor in self.actors]
        done, self.pending = ray.wait(self.pending, num_returns=len(self.pending), timeout=0)
        ray.get(done)  # raises a rank's exception

    def stop(self) -> None:
        import ray

        if self.stopped:
            return
        self.stopped = True
        distributed.destroy()
        for actor in self.actors:
            ray.kill(actor)
        ray.util.remove_placement_group(self.placement)


def start_ranks(config, size: int, device: torch.device) -> _Ranks:
    """Start ranks 1..size-1 and join the group as rank 0."""
    cuda = device.type == "cuda"
    if config.distributed_executor_backend == "ray":
        ranks, init_method = _start_ray(config, size, cuda)
    else:
        ranks, init_method = _start_subprocesses(config, size, cuda)
    os.environ.update(_NCCL_ENV)
    distributed.init_tensor_parallel(size, 0, init_method, backend_for(device), expert_dispatch(config))
    return ranks


def _start_subprocesses(config, size: int, cuda: bool) -> tuple[_Ranks, str]:
    authkey = secrets.token_bytes(16)
    listener = Listener(("127.0.0.1", 0), authkey=authkey)
    init_method = f"tcp://127.0.0.1:{_free_port()}"
    address = f"{listener.address[0]}:{listener.address[1]}"
    processes = [
        subprocess.Popen(
            [sys.executable, "-m", "tokenmill.worker.tp_executor", address, authkey.hex(), str(rank)],
            env={**os.environ, **_NCCL_ENV},
        )
        for rank in range(1, size)
    ]
    conns: list[Connection | None] = [None] * (size - 1)
    for _ in range(size - 1):
        conn = listener.accept()
        conns[conn.recv() - 1] = conn
    listener.close()
    for rank, conn in enumerate(conns, start=1):
        assert conn is not None
        conn.send((config, size, rank, init_method, rank if cuda else None))
    return _Subprocesses([c for c in conns if c is not None], processes), init_method


def _start_ray(config, size: int, cuda: bool) -> tuple[_Ranks, str]:
    try:
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
    except ImportError:
        raise ValueError(
            "distributed_executor_backend='ray' needs ray: pip install ray (or use 'mp' on one machine)."
        ) from None
    if not ray.is_initialized():
        ray.init(address=os.environ.get("RAY_ADDRESS"), runtime_env={"env_vars": _NCCL_ENV})
    resource = "GPU" if cuda else "CPU"
    placement = placement_group([{resource: 1}] * (size - 1), strategy="PACK")
    ray.get(placement.ready(), timeout=300)
    init_method = f"tcp://{ray.util.get_node_ip_address()}:{_free_port()}"
    actor_class = ray.remote(num_gpus=1 if cuda else 0, num_cpus=0 if cuda else 1)(RankWorker)
    actors = [
        actor_class.options(
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                placement, placement_group_bundle_index=rank - 1
            )
        ).remote(config, size, rank, init_method, 0 if cuda else None)  # Ray shows each actor its one GPU
        for rank in range(1, size)
    ]
    return _RayActors(actors, placement), init_method


def _serve(address: str, authkey: bytes, rank: int) -> None:
    """A subprocess rank: connect to rank 0, then carry out its orders until told to stop."""
    host, port = address.rsplit(":", 1)
    conn = Client((host, int(port)), authkey=authkey)
    conn.send(rank)
    code = 0
    try:
        worker = RankWorker(*conn.recv())
        while True:
            op, args = pickle.loads(conn.recv_bytes())
            if op == "stop":
                break
            getattr(worker, op)(*args)
    except EOFError:  # rank 0 is gone
        pass
    except BaseException:  # its own failure (a build refused): rank 0 sees it exited at its next order
        traceback.print_exc()
        code = 1
    # Nothing to keep: skip the interpreter's teardown of torch and the group (seconds; with a live group
    # it may never end).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING)
    _serve(sys.argv[1], bytes.fromhex(sys.argv[2]), int(sys.argv[3]))
