"""Prefill/decode disaggregation's network, in the engine-core process (the scheduler's side is
core/kv_transfer.py, the copies worker/kv_offload.py's BlockRows). Transport: ZMQ over TCP.

Prefill instance (`--kv-role prefill`): a ROUTER socket on `--kv-port` answers `fetch` with the KV of
a finished request's held blocks (then frees them) and `release` by freeing them; held blocks nobody
fetches are freed at their deadline.

Decode instance (`--kv-role decode`): for each request that got blocks for its prompt, a `fetch` goes to
the prefill peer named in the request (a DEALER socket per peer); the answer is handed to the scheduler,
and the next step copies it in. A fetch unanswered after `kv_transfer_timeout` seconds, or answered with
an error, ends its request: finish reason "abort" with the reason in EngineCoreOutput.error (its blocks
freed, the peer told to release); the server answers 503 `kv_transfer_failed`."""

from __future__ import annotations

import logging
import time

import msgspec
import zmq

from tokenmill.core.outputs import EngineCoreOutput
from tokenmill.core.request import Request, RequestStatus

logger = logging.getLogger("tokenmill.kv_transfer")


class KVMessage(msgspec.Struct, array_like=True):
    op: str  # "fetch" | "release" | "data" | "error"
    transfer_id: str
    request_id: str = ""  # the decode instance's request, echoed back
    data: bytes = b""
    error: str = ""


class KVServer:
    """The prefill side: serves held blocks to decode peers."""

    def __init__(self, context: zmq.Context, port: int, core) -> None:
        self.core = core
        self.socket = context.socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.bind(f"tcp://*:{port}")
        self.num_done = 0  # transfers served, their bytes and the time spent on them
        self.num_bytes = 0
        self.seconds = 0.0

    def close(self) -> None:
        self.socket.close(linger=0)

    def handle(self) -> bool:
        """Answer every message waiting; whether anything changed (blocks freed)."""
        transfers = self.core.scheduler.transfers
        changed = False
        while True:
            try:
                identity, frame = self.socket.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            message = msgspec.msgpack.decode(frame, type=KVMessage)
            changed = True
            if message.op == "release":
                transfers.release(message.transfer_id)
                continue
            start = time.perf_counter()
            blocks = transfers.held_blocks(message.transfer_id)
            if blocks is None:
                error = f"no KV held for {message.transfer_id} (expired or unknown)"
                reply = KVMessage("error", message.transfer_id, message.request_id, error=error)
            else:
                data = self.core.executor.export_blocks(blocks)
                transfers.release(message.transfer_id)
                reply = KVMessage("data", message.transfer_id, message.request_id, data=data)
                self.num_bytes += len(data)
                self.num_done += 1
            self.socket.send_multipart([identity, msgspec.msgpack.encode(reply)])
            self.seconds += time.perf_counter() - start
        return bool(transfers.expire()) or changed


class KVClient:
    """The decode side: fetches each waiting request's KV from its prefill peer."""

    def __init__(self, context: zmq.Context, core, timeout_s: float) -> None:
        self.context = context
        self.core = core
        self.timeout_s = timeout_s
        self.sockets: dict[str, zmq.Socket] = {}  # peer address -> DEALER
        # request id -> (request, when its fetch went out, its deadline)
        self.pending: dict[str, tuple[Request, float, float]] = {}
        self.num_done = 0  # transfers received, their bytes and the time from fetch to answer
        self.num_bytes = 0
        self.seconds = 0.0

    def _socket(self, address: str) -> zmq.Socket:
        socket = self.sockets.get(address)
        if socket is None:
            socket = self.context.socket(zmq.DEALER)
            socket.setsockopt(zmq.LINGER, 0)
            socket.connect(address)
            self.sockets[address] = socket
        return socket

    def handle(self) -> list[EngineCoreOutput]:
        """Send new fetches, take answers, fail overdue ones; returns the failed requests' outputs."""
        scheduler = self.core.scheduler
        now = time.monotonic()
        for request in scheduler.transfers.take_to_fetch():
            prefill = request.remote_prefill
            message = KVMessage("fetch", prefill.transfer_id, request.request_id)
            self._socket(prefill.kv_address).send(msgspec.msgpack.encode(message))
            self.pending[request.request_id] = (request, now, now + self.timeout_s)
        failed: list[EngineCoreOutput] = []
        for socket in self.sockets.values():
            while True:
                try:
                    frame = socket.recv(zmq.NOBLOCK)
                except zmq.Again:
                    break
                message = msgspec.msgpack.decode(frame, type=KVMessage)
                entry = self.pending.pop(message.request_id, None)
                if entry is None:
                    continue  # aborted meanwhile: its blocks are already free
                if message.op == "data":
                    self.num_bytes += len(message.data)
                    self.num_done += 1
                    self.seconds += time.monotonic() - entry[1]
                    scheduler.transfers.deliver(message.request_id, message.data)
                else:
                    failed.append(self._fail(entry[0], message.error))
        for request_id, (request, _, deadline) in list(self.pending.items()):
            if request.status.finished:  # aborted by its client: tell the peer to let go
                del self.pending[request_id]
                self._release(request)
            elif deadline <= now:
                del self.pending[request_id]
                self._release(request)
                failed.append(
                    self._fail(
                        request, f"no KV from {request.remote_prefill.kv_address} in {self.timeout_s:g} s"
                    )
                )
        return failed

    def _release(self, request: Request) -> None:
        prefill = request.remote_prefill
        self._socket(prefill.kv_address).send(
            msgspec.msgpack.encode(KVMessage("release", prefill.transfer_id))
        )

    def _fail(self, request: Request, reason: str) -> EngineCoreOutput:
        logger.warning("request %s: KV transfer failed: %s", request.request_id, reason)
        scheduler = self.core.scheduler
        if request.request_id in scheduler.requests:
            scheduler.abort_requests([request.request_id])
        request.status = RequestStatus.FINISHED_ABORTED
        return EngineCoreOutput(request.request_id, [], finish_reason="abort", error=reason)

    def close(self) -> None:
        for socket in self.sockets.values():
            socket.close(linger=0)
