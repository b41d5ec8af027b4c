"""The engine-core process: builds the engine, then loops drain requests -> step -> send outputs, so the
model runs step after step while the API process does HTTP, tokenization and detokenization."""

from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.connection
import os
import signal
import sys
import time
from collections.abc import Callable

import msgspec
import zmq

from tokenmill.config import EngineConfig
from tokenmill.core.engine import EngineCore
from tokenmill.core.kv_transfer import RemotePrefill
from tokenmill.core.outputs import EngineCoreOutput
from tokenmill.core.request import Request, RequestStatus
from tokenmill.gc_pauses import SERVER_LOG_OVER_S, GCPauses, freeze_startup
from tokenmill.serving.core_protocol import (
    AbortRequests,
    AddRequest,
    CoreRequest,
    EngineDead,
    EngineReady,
    SchedulerStats,
    Shutdown,
    StepOutputs,
    UtilityCall,
    UtilityResult,
    request_decoder,
)
from tokenmill.serving.kv_transfer import KVClient, KVServer
from tokenmill.serving.step_trace import StepTrace

# One row per step that returned outputs: when they left, how long the step() call took, and what the
# finished step computed.
CORE_TRACE_COLUMNS = ("sent_s", "step_call_ms", "tokens", "requests", "new_requests", "outputs")

logger = logging.getLogger("tokenmill.core")

# What the API process may ask the core outside the request flow; unknown names answer None.
UTILITY_METHODS: dict[str, Callable[[EngineCore], object]] = {
    "reset_prefix_cache": lambda core: core.scheduler.kv.reset_prefix_cache(),
    "num_unfinished_requests": lambda core: len(core.scheduler.requests),
}


class EngineCoreProc:
    """The busy loop around an EngineCore, reading requests from and writing outputs to ZMQ sockets."""

    def __init__(
        self,
        core: EngineCore,
        input_socket: zmq.Socket,
        output_sockets: list[zmq.Socket],
        parent_sentinel: int | None = None,
        step_trace: StepTrace | None = None,
        kv_server: KVServer | None = None,
        kv_client: KVClient | None = None,
    ) -> None:
        """kv_server, kv_client: the network of prefill/decode disaggregation (serving/kv_transfer.py),
        on a prefill and a decode instance."""
        self.core = core
        self.kv_server = kv_server
        self.kv_client = kv_client
        self.step_trace = step_trace
        self.input_socket = input_socket
        # One per API process; index i answers the requests sent with client_index i.
        self.output_sockets = output_sockets
        self.parent_sentinel = parent_sentinel
        self.client_of: dict[str, int] = {}  # request id -> API process, with several of them
        self.decoder = request_decoder()
        self.encoder = msgspec.msgpack.Encoder()
        self.shutdown_requested = False
        # Requests not yet scheduled once, for the queue-time histogram.
        self.unscheduled: dict[str, Request] = {}

    def run(self) -> None:
        poller = zmq.Poller()
        poller.register(self.input_socket, zmq.POLLIN)
        if self.parent_sentinel is not None:
            poller.register(self.parent_sentinel, zmq.POLLIN)
        if self.kv_server is not None:
            poller.register(self.kv_server.socket, zmq.POLLIN)
        while not self.shutdown_requested:
            events = dict(poller.poll(self._poll_timeout()))
            if self.parent_sentinel is not None and self.parent_sentinel in events:
                logger.warning("API process is gone; engine core exiting.")
                return
            changed = self._drain_requests() if self.input_socket in events else False
            if self.shutdown_requested:
                return
            failed: list[EngineCoreOutput] = []
            if self.kv_server is not None:
                changed = self.kv_server.handle() or changed
            if self.kv_client is not None:
                failed = self.kv_client.handle()
            self._step(changed or bool(failed), failed)

    def _poll_timeout(self) -> int | None:
        """Block only when idle; with work to do, look at the sockets without waiting; while requests wait
        for KV (or blocks are held for a peer), look every few milliseconds."""
        core = self.core
        if core.batch_queue or core.scheduler.has_runnable_requests():
            return 0
        if self.kv_client is not None and self.kv_client.pending:
            return 2
        if core.has_unfinished_requests() or (self.kv_server is not None and core.scheduler.transfers.held):
            return 50
        return None

    def _step(self, changed: bool, failed: list[EngineCoreOutput] | None = None) -> None:
        outputs: list[EngineCoreOutput] = list(failed or [])
        steps_before = self.core.num_steps
        start = time.monotonic()
        if self.core.has_unfinished_requests():
            outputs += self.core.step()
        # Idle steps are not reported; a change of state (an abort, a new request) always is, so the
        # API process's gauges never keep a stale count of running requests or used blocks.
        if not (outputs or changed or self.core.num_steps != steps_before):
            return
        finished = self.core.last_finished  # outputs always come from a finished step
        if self.step_trace is not None and outputs and finished is not None:
            now = time.monotonic()
            self.step_trace.add(
                now, (now - start) * 1e3, finished.total_num_scheduled_tokens,
                len(finished.num_scheduled_tokens), len(finished.scheduled_new_reqs), len(outputs),
            )  # fmt: skip
        stats = self._stats(self._queue_times(start))
        if len(self.output_sockets) == 1:
            self._send(StepOutputs(outputs, stats))
            return
        # Each API process gets its own requests' outputs; process 0, which records the core's
        # metrics, gets every step's stats.
        per_client: list[list[EngineCoreOutput]] = [[] for _ in self.output_sockets]
        client_of = self.client_of
        for output in outputs:
            if output.finish_reason is None:
                per_client[client_of.get(output.request_id, 0)].append(output)
            else:
                per_client[client_of.pop(output.request_id, 0)].append(output)
        for index, client_outputs in enumerate(per_client):
            if client_outputs or index == 0:
                self._send(StepOutputs(client_outputs, stats), index)

    def _drain_requests(self) -> bool:
        handled = False
        while not self.shutdown_requested:
            try:
                frame = self.input_socket.recv(zmq.NOBLOCK)
            except zmq.Again:
                break
            self._handle(self.decoder.decode(frame))
            handled = True
        return handled

    def _handle(self, message: CoreRequest) -> None:
        if isinstance(message, AddRequest):
            request = Request(
                message.request_id,
                message.prompt_token_ids,
                message.params,
                tuple(message.eos_token_ids),
                arrival_time=message.arrival_time,
                priority=message.priority,
                cache_salt=message.cache_salt,
            )
            request.remote_decode = message.remote_decode
            if message.remote_prefill is not None:
                request.remote_prefill = RemotePrefill(*message.remote_prefill)
            try:
                self.core.add_request(request)
            except ValueError as exc:
                # A duplicate id is the API process's bug, not a reason to stop serving everyone else.
                logger.error("rejected request %s: %s", message.request_id, exc)
                rejected = EngineCoreOutput(message.request_id, [], finish_reason="abort")
                self._send(StepOutputs([rejected], self._stats([])), message.client_index)
                return
            self.unscheduled[request.request_id] = request
            if message.client_index:
                self.client_of[request.request_id] = message.client_index
        elif isinstance(message, AbortRequests):
            self.core.abort_requests(message.request_ids)
            for request_id in message.request_ids:
                self.unscheduled.pop(request_id, None)
                self.client_of.pop(request_id, None)
        elif isinstance(message, UtilityCall):
            method = UTILITY_METHODS.get(message.method)
            result = None if method is None else method(self.core)
            self._send(UtilityResult(message.call_id, result), message.client_index)
        elif isinstance(message, Shutdown):
            self.shutdown_requested = True

    def _queue_times(self, step_start: float) -> list[float]:
        queue_times = []
        for request_id, request in list(self.unscheduled.items()):
            if request.status == RequestStatus.WAITING:
                continue
            del self.unscheduled[request_id]
            if request.status != RequestStatus.FINISHED_ABORTED:
                queue_times.append(max(0.0, step_start - request.arrival_time))
        return queue_times

    def _stats(self, queue_times: list[float]) -> SchedulerStats:
        scheduler = self.core.scheduler
        kv = scheduler.kv
        return SchedulerStats(
            num_running=scheduler.num_running,
            num_waiting=scheduler.num_waiting,
            kv_cache_usage=kv.usage,
            num_used_blocks=kv.pool.num_blocks - kv.pool.num_free_blocks,
            prefix_cache_queries=kv.prefix_cache_queries,
            prefix_cache_hits=kv.prefix_cache_hits,
            num_preemptions=scheduler.num_preemptions,
            queue_times=queue_times,
            spec_num_drafts=scheduler.spec.num_drafts,
            spec_num_draft_tokens=scheduler.spec.num_draft_tokens,
            spec_num_accepted_tokens=scheduler.spec.num_accepted_tokens,
            spec_accepted_per_position=list(scheduler.spec.accepted_per_position),
            **_offload_stats(kv, getattr(self.core.executor, "host_kv", None)),
            **self._transfer_stats(),
        )

    def _transfer_stats(self) -> dict:
        side = self.kv_server or self.kv_client
        if side is None:
            return {}
        return {
            "kv_transfers": side.num_done,
            "kv_transfer_bytes": side.num_bytes,
            "kv_transfer_seconds": side.seconds,
        }

    def _send(self, message: object, client_index: int = 0) -> None:
        """A PUSH socket blocks while its peer is away: an API process that died mid-stream would hold
        the core in send forever, past the parent check. So: never block; while the peer is away, wait
        for it in small steps, unless the parent is gone (then stop serving)."""
        frame = self.encoder.encode(message)
        socket = self.output_sockets[client_index]
        while True:
            try:
                socket.send(frame, zmq.NOBLOCK)
                return
            except zmq.Again:
                if self._parent_gone():
                    logger.warning("API process is gone; engine core exiting.")
                    self.shutdown_requested = True
                    return
                time.sleep(0.001)

    def _parent_gone(self) -> bool:
        if self.parent_sentinel is None:
            return False
        return bool(multiprocessing.connection.wait([self.parent_sentinel], timeout=0))


def _offload_stats(kv, host_kv) -> dict:
    if kv.host is None or host_kv is None:
        return {}
    return {
        "offload_hits": kv.offload_hits,
        "offload_saved_blocks": kv.host.num_saved,
        "offload_loaded_blocks": kv.host.num_loaded,
        "offload_bytes_saved": host_kv.bytes_saved,
        "offload_bytes_loaded": host_kv.bytes_loaded,
        "offload_disk_hits": kv.disk_hits,
        "offload_spilled_blocks": kv.host.disk.num_spilled if kv.host.disk is not None else 0,
        "offload_disk_read_blocks": kv.host.disk.num_read if kv.host.disk is not None else 0,
        "offload_bytes_spilled": host_kv.bytes_spilled,
        "offload_bytes_disk_read": host_kv.bytes_read,
        "offload_seconds": host_kv.host_seconds,
    }


def _limit_cpu_threads(config: EngineConfig) -> None:
    """On CPU, leave one core to the API process. OpenMP threads spin while they wait, so a core process
    using every core fights the API process (and anything else on the box): on a loaded 2-core machine a
    decode step measured 10-50x slower with 2 threads than with 1. OMP_NUM_THREADS, if set, wins."""
    import torch

    on_cpu = config.device == "cpu" or (config.device == "auto" and not torch.cuda.is_available())
    if on_cpu and "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) - 1))


def run_engine_core(config: EngineConfig, input_addresses: list[str], output_addresses: list[str]) -> None:
    """Entry point of the engine-core process (started with the multiprocessing spawn context). It reads
    requests from every input address (one per API process, plus the launcher's with several) and
    answers API process i on output_addresses[i]."""
    # Whoever started the core decides when it stops (after draining); Ctrl-C reaches the whole process
    # group, so the core ignores it and waits for a Shutdown message or its parent's death.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s engine-core: %(message)s")
    context = zmq.Context()
    output_sockets = []
    for address in output_addresses:
        output_sockets.append(context.socket(zmq.PUSH))
        output_sockets[-1].setsockopt(zmq.SNDHWM, 0)  # outputs are never dropped or held back
        output_sockets[-1].connect(address)
    input_socket = context.socket(zmq.PULL)
    for address in input_addresses:
        input_socket.connect(address)
    encoder = msgspec.msgpack.Encoder()

    def send_all(message: object) -> None:
        frame = encoder.encode(message)
        for socket in output_sockets:
            socket.send(frame)

    exit_code = 0
    parts = kv_server = kv_client = None
    try:
        # Imported here, not at the top: an API process imports this module to start the core, and
        # the model's modules (torch, transformers: seconds) are the core's to import.
        from tokenmill.serving.engine_setup import create_engine

        _limit_cpu_threads(config)
        parts = create_engine(config)
        freeze_startup()  # the model and the engine live as long as this process
        GCPauses("engine core", log_over_s=SERVER_LOG_OVER_S).install()
        hf_config = parts.source.hf_config
        send_all(
            EngineReady(
                max_model_len=parts.max_model_len,
                num_kv_blocks=parts.num_kv_blocks,
                block_size=config.block_size,
                vocab_size=hf_config.vocab_size,
                pooling_type=parts.pooling_type,
            )
        )
        parent = multiprocessing.parent_process()
        sentinel = parent.sentinel if parent is not None else None
        trace = StepTrace.from_env(CORE_TRACE_COLUMNS)
        kv_server = KVServer(context, config.kv_port, parts.core) if config.kv_role == "prefill" else None
        kv_client = (
            KVClient(context, parts.core, config.kv_transfer_timeout) if config.kv_role == "decode" else None
        )
        EngineCoreProc(parts.core, input_socket, output_sockets, sentinel, trace, kv_server, kv_client).run()
        if trace is not None:
            trace.write()
    except Exception as exc:
        # A ValueError is a bad configuration (an unsupported architecture, a KV cache too small): the
        # API process prints its message as one clean line, the traceback is for --log-level debug.
        if isinstance(exc, ValueError):
            logger.debug("engine core failed", exc_info=True)
        else:
            logger.exception("engine core failed")
        send_all(EngineDead(str(exc), type(exc).__name__))
        exit_code = 1
    finally:
        shutdown = getattr(parts.core.executor, "shutdown", None) if parts is not None else None
        if shutdown is not None:  # other tensor-parallel ranks
            shutdown()
        for kv_socket_owner in (kv_server, kv_client):
            if kv_socket_owner is not None:  # else context.term() below waits for their sockets forever
                kv_socket_owner.close()
        input_socket.close(linger=0)
        for socket in output_sockets:
            socket.close(linger=2000)  # let the last message (outputs or the error) reach the API
        context.term()
    sys.exit(exit_code)
