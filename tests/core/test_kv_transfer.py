"""Prefill/decode disaggregation's engine side, in one process (CPU, embedded SmolLM2, fp32): a prefill
engine computes a prompt and samples one token for a `remote_decode` request and holds its blocks; their
KV, exported as bytes, lets a decode engine take the request over without computing a single prompt
token; its greedy tokens equal one engine's. Held blocks go back when released or when their deadline
passes; a decode request aborted while waiting for its KV frees its reserved blocks."""

from __future__ import annotations

import pytest

from tokenmill import LLM, SamplingParams
from tokenmill.core.kv_transfer import RemotePrefill
from tokenmill.core.request import Request

PROMPTS = [
    "The history of the printing press begins with",
    "Write three facts about the moon: first, it is",
    "Once upon a time, in a village by the sea, there lived a fisherman who",
]


def engine() -> LLM:
    return LLM("default", dtype="float32", max_model_len=512, num_kv_blocks=64)


def run(core, requests: list[Request], deliver=None) -> dict[str, list[int]]:
    for request in requests:
        core.add_request(request)
    tokens: dict[str, list[int]] = {r.request_id: [] for r in requests}
    for _ in range(500):
        if not core.has_unfinished_requests():
            break
        for output in core.step():
            tokens[output.request_id] += output.new_token_ids
        if deliver is not None:
            for request in core.scheduler.transfers.take_to_fetch():
                deliver(request)
    return tokens


@pytest.fixture(scope="module")
def engines():
    return engine(), engine()


def test_a_decode_engine_takes_over_from_the_prefill_engines_kv(engines) -> None:
    prefill, decode = engines
    tokenizer = prefill.get_tokenizer()
    ids = [tokenizer.encode(p) for p in PROMPTS]
    params = SamplingParams(max_tokens=12, temperature=0)
    # The reference: the prefill engine serving the requests whole, as a plain engine.
    want = run(prefill.engine.core, [Request(f"s{i}", p, params) for i, p in enumerate(ids)])

    prefill_requests = []
    for i, p in enumerate(ids):
        request = Request(f"p{i}", p, SamplingParams(max_tokens=1, temperature=0))
        request.remote_decode = True
        prefill_requests.append(request)
    first = run(prefill.engine.core, prefill_requests)
    transfers = prefill.engine.core.scheduler.transfers
    assert set(transfers.held) == {"p0", "p1", "p2"}
    used = prefill.engine.core.scheduler.kv.pool.num_free_blocks

    def deliver(request: Request) -> None:
        transfer_id = request.remote_prefill.transfer_id
        data = prefill.engine.runner.export_blocks(transfers.held_blocks(transfer_id))
        transfers.release(transfer_id)
        decode.engine.core.scheduler.transfers.deliver(request.request_id, data)

    decode_requests = []
    for i, p in enumerate(ids):
        request = Request(f"d{i}", p, params)
        request.remote_prefill = RemotePrefill(first[f"p{i}"][0], "in-process", f"p{i}")
        decode_requests.append(request)
    got = run(decode.engine.core, decode_requests, deliver)
    assert [got[f"d{i}"] for i in range(3)] == [want[f"s{i}"] for i in range(3)]
    # Every prompt token came from the prefill engine: the decode engine computed only output positions.
    kv = decode.engine.core.scheduler.kv
    assert kv.prefix_cache_queries == 0
    assert not transfers.held and prefill.engine.core.scheduler.kv.pool.num_free_blocks > used
    assert kv.pool.num_free_blocks == kv.pool.num_blocks  # nothing leaked on either side
    assert prefill.engine.core.scheduler.kv.pool.num_free_blocks == kv.pool.num_blocks


def test_held_blocks_expire_and_waiting_requests_free_on_abort(engines) -> None:
    prefill, decode = engines
    request = Request("held", list(range(40, 90)), SamplingParams(max_tokens=1, temperature=0))
    request.remote_decode = True
    run(prefill.engine.core, [request])
    scheduler = prefill.engine.core.scheduler
    assert scheduler.transfers.held_blocks("held")
    assert scheduler.transfers.expire() == []  # not yet
    assert scheduler.transfers.expire(now=float("inf")) == ["held"]
    assert scheduler.kv.pool.num_free_blocks == scheduler.kv.pool.num_blocks

    waiting = Request("waits", list(range(40, 90)), SamplingParams(max_tokens=5))
    waiting.remote_prefill = RemotePrefill(7, "nowhere", "gone")
    core = decode.engine.core
    core.add_request(waiting)
    core.step()  # reserves its blocks; its KV never comes
    assert waiting.block_ids and core.scheduler.transfers.take_to_fetch() == [waiting]
    assert core.scheduler.num_waiting == 1  # load, as a router reading the gauge should see it
    core.abort_requests(["waits"])
    assert not core.has_unfinished_requests() and not core.scheduler.transfers.awaiting
    assert core.scheduler.kv.pool.num_free_blocks == core.scheduler.kv.pool.num_blocks


def test_arrived_kv_beyond_a_steps_room_waits_for_the_next_step() -> None:
    from tokenmill.core.kv_cache import KVCacheManager
    from tokenmill.core.kv_transfer import KVTransfers

    transfers = KVTransfers(KVCacheManager(num_blocks=16, block_size=4))
    requests = []
    for i in range(3):
        request = Request(f"r{i}", list(range(10)), SamplingParams(max_tokens=2))
        request.remote_prefill = RemotePrefill(1, "peer", f"p{i}")
        transfers.add(request)
        requests.append(request)
    transfers.reserve()
    assert [r.request_id for r in transfers.take_to_fetch()] == ["r0", "r1", "r2"]
    for request in requests:
        transfers.deliver(request.request_id, b"kv")
    assert [r.request_id for r, _ in transfers.ready(2)] == ["r0", "r1"]
    assert [r.request_id for r, _ in transfers.ready(2)] == ["r2"]
    assert transfers.ready(2) == [] and not transfers.awaiting
