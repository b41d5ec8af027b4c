"""The engine core in its own process behind AsyncEngineClient, on a tiny random model: the same tokens as
the in-process engine, aborts that free KV blocks at once, the waiting cap, start-up errors, core death."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
import time
from collections.abc import Coroutine, Iterator

import pytest
import torch

from tokenmill.config import EngineConfig
from tokenmill.outputs import RequestOutput
from tokenmill.sampling_params import SamplingParams
from tokenmill.serving.async_client import AsyncEngineClient
from tokenmill.serving.core_link import EngineDeadError, EngineOverloadedError
from tokenmill.serving.llm_engine import LLMEngine
from tokenmill.serving.metrics import ServerMetrics

PROMPTS = [[1, 5, 7, 9, 11], [1, 20, 30], [1, 5, 7, 9, 11, 13, 15, 17, 19]]


class LoopThread:
    """An event loop on a background thread, so synchronous tests can drive async code step by step."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coroutine: Coroutine, timeout: float = 120.0):
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join()
        self.loop.close()


def tiny_config(path: str, **overrides) -> EngineConfig:
    options = dict(model=path, skip_tokenizer_init=True, device="cpu", max_model_len=128, num_kv_blocks=32)
    return EngineConfig(**{**options, **overrides})


@pytest.fixture(scope="module")
def loop() -> Iterator[LoopThread]:
    thread = LoopThread()
    yield thread
    thread.close()


@pytest.fixture(scope="module")
def model_path(hf_model_dirs) -> str:
    return hf_model_dirs["llama"][0]


@pytest.fixture(scope="module")
def engine(loop: LoopThread, model_path: str) -> Iterator[AsyncEngineClient]:
    client = loop.run(AsyncEngineClient.start(tiny_config(model_path), ServerMetrics("tiny")))
    yield client
    loop.run(client.shutdown())


async def collect(engine: AsyncEngineClient, request_id: str, prompt: list[int], params: SamplingParams):
    return [output async for output in engine.add_request(request_id, prompt, params)]


@pytest.fixture(scope="module")
def offline(model_path: str) -> LLMEngine:
    return LLMEngine(tiny_config(model_path))


def offline_tokens(offline: LLMEngine, params: SamplingParams) -> list[list[list[int]]]:
    """Every prompt's samples' token ids from the in-process engine, all prompts batched together."""
    request_ids = [f"{id(params)}-{i}" for i in range(len(PROMPTS))]
    for request_id, prompt in zip(request_ids, PROMPTS, strict=True):
        offline.add_request(request_id, prompt, params)
    finals: dict[str, RequestOutput] = {}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as in the core process on this machine (see core_process._limit_cpu_threads)
    try:
        while offline.has_unfinished_requests():
            finals.update({o.request_id: o for o in offline.step() if o.finished})
    finally:
        torch.set_num_threads(threads)
    return [[c.token_ids for c in finals[request_id].outputs] for request_id in request_ids]


def test_outputs_equal_the_in_process_engine(loop, engine, offline):
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)

    async def all_at_once():
        return await asyncio.gather(*(collect(engine, f"g{i}", p, params) for i, p in enumerate(PROMPTS)))

    results = loop.run(all_at_once())
    served = [[c.token_ids for c in outputs[-1].outputs] for outputs in results]
    assert served == offline_tokens(offline, params)
    for outputs in results:
        # Streamed: an output per step, unless some queued up behind the consumer and were merged.
        assert [o.finished for o in outputs] == [False] * (len(outputs) - 1) + [True]
        deltas = [t for o in outputs for t in o.outputs[0].delta_token_ids]
        assert deltas == outputs[-1].outputs[0].token_ids
        assert outputs[-1].outputs[0].finish_reason == "length"


def test_outputs_queued_behind_a_slow_consumer_arrive_merged(loop, engine, offline):
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)

    async def read_after_the_end():
        stream = engine.add_request("late", PROMPTS[0], params)
        while engine.num_open_requests:  # every output is queued before the first read
            await asyncio.sleep(0.01)
        return [output async for output in stream]

    (output,) = loop.run(read_after_the_end())
    (completion,) = output.outputs
    assert output.finished and completion.finish_reason == "length"
    assert completion.delta_token_ids == completion.token_ids == offline_tokens(offline, params)[0][0]


def test_seeded_samples_fan_out_and_reproduce(loop, engine, offline):
    params = SamplingParams(n=2, temperature=1.0, seed=7, max_tokens=8, ignore_eos=True)
    first = loop.run(collect(engine, "s1", PROMPTS[0], params))[-1]
    second = loop.run(collect(engine, "s2", PROMPTS[0], params))[-1]
    tokens = [c.token_ids for c in first.outputs]
    assert [c.index for c in first.outputs] == [0, 1] and all(len(t) == 8 for t in tokens)
    assert tokens == [c.token_ids for c in second.outputs]
    assert tokens == offline_tokens(offline, params)[0]


def test_stop_token_ids_finish_with_the_stop_reason(loop, engine):
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    tokens = loop.run(collect(engine, "t1", PROMPTS[1], greedy))[-1].outputs[0].token_ids
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, stop_token_ids=[tokens[2]])
    final = loop.run(collect(engine, "t2", PROMPTS[1], params))[-1].outputs[0]
    assert final.token_ids == tokens[: tokens.index(tokens[2]) + 1]
    assert (final.finish_reason, final.stop_reason) == ("stop", tokens[2])


def gauge(engine: AsyncEngineClient, name: str) -> float:
    return engine.metrics.registry.get_sample_value(
        f"tokenmill:{name}", {"model_name": "tiny", "engine": "0"}
    )


def test_closing_a_stream_aborts_and_frees_its_blocks(loop, engine):
    async def scenario():
        stream = engine.add_request("a1", PROMPTS[2], SamplingParams(max_tokens=100, ignore_eos=True))
        await anext(stream)
        used_while_running = gauge(engine, "kv_cache_used_blocks")
        await stream.aclose()
        deadline = time.monotonic() + 10
        while gauge(engine, "kv_cache_used_blocks") and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        return used_while_running, await engine.num_unfinished_in_core()

    used_while_running, unfinished = loop.run(scenario())
    assert used_while_running == 1  # 9 prompt tokens and the first output fit one 16-token block
    assert unfinished == 0 and engine.num_open_requests == 0
    assert gauge(engine, "kv_cache_used_blocks") == 0 and gauge(engine, "num_requests_running") == 0


def test_waiting_cap_rejects_before_submitting(loop, engine, monkeypatch):
    monkeypatch.setattr(engine.config, "max_waiting_requests", 1)

    async def scenario():
        first = engine.add_request("w1", PROMPTS[0], SamplingParams(max_tokens=50, ignore_eos=True))
        with pytest.raises(EngineOverloadedError, match="waiting queue is full"):
            engine.add_request("w2", PROMPTS[0], SamplingParams(max_tokens=1))
        await anext(first)  # the first one started: room again
        second = engine.add_request("w3", PROMPTS[0], SamplingParams(max_tokens=1))
        await first.aclose()
        return [o async for o in second]

    assert loop.run(scenario())[-1].finished


def test_bad_requests_fail_alone(loop, engine):
    async def scenario():
        with pytest.raises(ValueError, match="token ids"):
            engine.add_request("b1", [10**6], SamplingParams())
        stream = engine.add_request("b2", PROMPTS[0], SamplingParams(max_tokens=2))
        with pytest.raises(ValueError, match="already in use"):
            engine.add_request("b2", PROMPTS[0], SamplingParams(max_tokens=2))
        return [o async for o in stream]

    assert loop.run(scenario())[-1].outputs[0].token_ids


def test_start_up_error_in_the_core_is_raised_by_start(loop, model_path):
    with pytest.raises(ValueError, match="max_model_len=100000 exceeds"):
        loop.run(AsyncEngineClient.start(tiny_config(model_path, max_model_len=100000)))


def test_core_death_fails_open_requests_fast(loop, model_path):
    client = loop.run(AsyncEngineClient.start(tiny_config(model_path)))
    died = threading.Event()
    client.add_dead_callback(died.set)

    async def scenario():
        stream = client.add_request("d1", PROMPTS[0], SamplingParams(max_tokens=120, ignore_eos=True))
        await anext(stream)
        os.kill(client.process.pid, signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(EngineDeadError, match="died unexpectedly"):
            async for _ in stream:
                pass
        return time.monotonic() - start

    assert loop.run(scenario()) < 2
    assert died.is_set() and client.dead_error is not None
    with pytest.raises(EngineDeadError):
        client.add_request("d2", PROMPTS[0], SamplingParams())
    loop.run(client.shutdown())


def test_two_api_clients_share_one_core(loop, model_path, offline, tmp_path):
    """`--api-server-count 2` underneath: one core, two attached clients. Each gets its own requests'
    outputs and its own utility answers; only client 0 gets (and records) every step's stats; the core
    outlives the clients, and its death reaches the one that did not start it."""
    import multiprocessing

    from tokenmill.serving.core_process import run_engine_core

    inputs = [f"ipc://{tmp_path}/in{i}" for i in range(2)]
    outputs = [f"ipc://{tmp_path}/out{i}" for i in range(2)]
    config = tiny_config(model_path)
    spawn = multiprocessing.get_context("spawn")
    core = spawn.Process(target=run_engine_core, args=(config, inputs, outputs))
    core.start()
    metrics = [ServerMetrics("tiny"), ServerMetrics("tiny")]
    try:
        clients = [
            loop.run(AsyncEngineClient.attach(config, metrics[i], inputs[i], outputs[i], i, core.pid))
            for i in range(2)
        ]
        params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)

        async def all_at_once():
            streams = [collect(clients[i % 2], f"two-{i}", p, params) for i, p in enumerate(PROMPTS)]
            return await asyncio.gather(*streams)

        results = loop.run(all_at_once())
        assert [[c.token_ids for c in out[-1].outputs] for out in results] == offline_tokens(offline, params)
        assert all(not c.num_open_requests for c in clients)
        assert loop.run(clients[1].num_unfinished_in_core()) == 0  # answered to client 1, not 0

        def count(index: int, name: str) -> float:
            sample = f"tokenmill:{name}"
            return metrics[index].registry.get_sample_value(sample, {"model_name": "tiny", "engine": "0"})

        # Queue times come with the core's stats: client 0 saw all three requests, client 1 none.
        assert count(0, "request_queue_time_seconds_count") == 3
        assert count(1, "request_queue_time_seconds_count") == 0
        assert count(0, "generation_tokens_total") == 24 and count(1, "generation_tokens_total") == 12

        loop.run(clients[0].shutdown())  # an attached client leaves the core running
        assert core.is_alive() and not clients[1].dead_error
        core.kill()
        assert wait_until(lambda: clients[1].dead_error is not None)
        assert "died unexpectedly" in clients[1].dead_error
        loop.run(clients[1].shutdown())
    finally:
        core.kill()
        core.join()


def wait_until(condition, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.02)
    return bool(condition())


def test_step_trace_records_each_step_that_returned_outputs(loop, model_path, tmp_path, monkeypatch):
    path = tmp_path / "steps.json"
    monkeypatch.setenv("TOKENMILL_STEP_TRACE", str(path))
    client = loop.run(AsyncEngineClient.start(tiny_config(model_path)))
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)

    async def all_at_once():
        return await asyncio.gather(*(collect(client, f"t{i}", p, params) for i, p in enumerate(PROMPTS)))

    loop.run(all_at_once())
    loop.run(client.shutdown())
    trace = json.loads(path.read_text())
    rows = [dict(zip(trace["columns"], row, strict=True)) for row in trace["rows"]]
    # Each step that returned outputs is one row: every token of every request shows up once.
    assert sum(row["outputs"] for row in rows) == len(PROMPTS) * 6
    assert sum(row["new_requests"] for row in rows) == len(PROMPTS)
    assert sum(row["tokens"] for row in rows) == sum(len(p) for p in PROMPTS) + len(PROMPTS) * 5
    assert all(row["step_call_ms"] >= 0 for row in rows)
    assert [row["sent_s"] for row in rows] == sorted(row["sent_s"] for row in rows)
    # The API side's trace: each step's outputs as they arrived, the same tokens in all.
    api = json.loads((tmp_path / "steps.json.api0").read_text())
    received = [dict(zip(api["columns"], row, strict=True)) for row in api["rows"]]
    assert sum(row["outputs"] for row in received) == len(PROMPTS) * 6
    assert all(row["longest_wait_ms"] >= 0 and row["process_ms"] >= 0 for row in received)
