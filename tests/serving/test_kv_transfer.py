"""The decode side's fetch (serving/kv_transfer.py) against a peer that never answers, and the prefill
side's answers: a KV that does not come within kv_transfer_timeout ends its request with
kv_transfer_failed and frees its blocks; a fetch of blocks nobody holds is an error answer."""

from __future__ import annotations

import time

import msgspec
import pytest
import zmq

from tests.entrypoints.openai.conftest import free_port
from tokenmill import LLM, SamplingParams
from tokenmill.core.kv_transfer import RemotePrefill
from tokenmill.core.request import Request
from tokenmill.serving.kv_transfer import KVClient, KVMessage, KVServer


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM("default", dtype="float32", max_model_len=256, num_kv_blocks=32)


def test_a_kv_that_never_comes_fails_its_request_and_frees_its_blocks(llm) -> None:
    core = llm.engine.core
    context = zmq.Context()
    silent = context.socket(zmq.ROUTER)  # a peer that takes the fetch and never answers
    port = free_port()
    silent.bind(f"tcp://127.0.0.1:{port}")
    client = KVClient(context, core, timeout_s=0.3)
    try:
        request = Request("r", list(range(100, 140)), SamplingParams(max_tokens=4))
        request.remote_prefill = RemotePrefill(5, f"tcp://127.0.0.1:{port}", "p-1")
        core.add_request(request)
        core.step()
        failed = []
        deadline = time.monotonic() + 5
        while not failed and time.monotonic() < deadline:
            failed = client.handle()
            time.sleep(0.05)
        assert len(failed) == 1 and failed[0].finish_reason == "abort"
        assert failed[0].error.startswith("no KV from tcp://127.0.0.1") and failed[0].stop_reason is None
        assert not core.has_unfinished_requests()
        assert core.scheduler.kv.pool.num_free_blocks == core.scheduler.kv.pool.num_blocks
        # The peer got the fetch, then a release.
        ops = [msgspec.msgpack.decode(silent.recv_multipart()[1], type=KVMessage).op for _ in range(2)]
        assert ops == ["fetch", "release"]
    finally:
        client.close()
        silent.close(linger=0)
        context.term()


def test_the_prefill_side_answers_an_unknown_transfer_with_an_error(llm) -> None:
    context = zmq.Context()
    port = free_port()
    server = KVServer(context, port, llm.engine.core)
    asker = context.socket(zmq.DEALER)
    asker.connect(f"tcp://127.0.0.1:{port}")
    try:
        asker.send(msgspec.msgpack.encode(KVMessage("fetch", "nobody", "r")))
        deadline = time.monotonic() + 5
        while not server.handle() and time.monotonic() < deadline:
            time.sleep(0.01)
        reply = msgspec.msgpack.decode(asker.recv(), type=KVMessage)
        assert reply.op == "error" and "nobody" in reply.error and reply.request_id == "r"
    finally:
        asker.close(linger=0)
        server.socket.close(linger=0)
        context.term()
