"""64 streaming requests at once, a third of them cancelled (half before their first token, half
mid-stream): the rest finish with the right text, and afterwards no request runs and no KV block is
held beyond the prefix cache."""

from __future__ import annotations

import asyncio
import threading
import time

import httpx
import pytest

from .conftest import wait_for

NUM_REQUESTS = 64
MAX_TOKENS = 6
QUESTIONS = ["Name a color.", "Name an animal.", "Name a city.", "Name a fruit."]


def messages(i: int) -> list[dict[str, str]]:
    return [{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}]


async def one_request(client, i: int) -> tuple[str, str | None, int | None]:
    """Returns (how it went, the streamed text, completion tokens)."""
    stream = await client.chat.completions.create(
        model="default",
        messages=messages(i),
        max_tokens=MAX_TOKENS,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    text, num_content_chunks = "", 0
    async for chunk in stream:
        if i % 6 == 0:  # leave right after the role chunk, before any token
            await stream.close()
            return "cancelled before first token", None, None
        if chunk.usage is not None:
            return "completed", text, chunk.usage.completion_tokens
        delta = chunk.choices[0].delta.content
        if delta:
            text += delta
            num_content_chunks += 1
            if i % 6 == 3 and num_content_chunks == 2:  # leave mid-stream
                await stream.close()
                return "cancelled mid-stream", None, None
    raise AssertionError(f"request {i}: stream ended without a usage chunk")


def test_64_streams_with_a_third_cancelled(server, client):
    expected = {
        q: client.chat.completions.create(
            model="default",
            messages=messages(i),
            max_tokens=MAX_TOKENS,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        .choices[0]
        .message.content
        for i, q in enumerate(QUESTIONS)
    }
    aborts_before = server.metrics().get(
        'tokenmill:request_success_total{engine="0",finished_reason="abort",model_name="default"}', 0.0
    )

    async def run_all():
        async with server.async_client() as async_client:
            return await asyncio.gather(*(one_request(async_client, i) for i in range(NUM_REQUESTS)))

    results = asyncio.run(run_all())
    outcomes = [outcome for outcome, _, _ in results]
    num_early = len(range(0, NUM_REQUESTS, 6))
    assert outcomes.count("cancelled before first token") == num_early == 11
    assert outcomes.count("cancelled mid-stream") == len(range(3, NUM_REQUESTS, 6)) == 11
    assert outcomes.count("completed") == 42
    for i, (outcome, text, completion_tokens) in enumerate(results):
        if outcome == "completed":
            assert completion_tokens == MAX_TOKENS
            assert text == expected[QUESTIONS[i % len(QUESTIONS)]], i  # batched greedy == alone greedy

    def drained() -> dict[str, float] | None:
        metrics = server.metrics()
        idle = (
            metrics["tokenmill:num_requests_running"] == 0
            and metrics["tokenmill:num_requests_waiting"] == 0
            and metrics["tokenmill:kv_cache_used_blocks"] == 0
        )
        return metrics if idle else None

    metrics = wait_for(drained, timeout=20)
    assert metrics, server.metrics()
    assert metrics["tokenmill:kv_cache_usage_perc"] == 0
    aborts = metrics[
        'tokenmill:request_success_total{engine="0",finished_reason="abort",model_name="default"}'
    ]
    assert aborts - aborts_before >= num_early  # at least every request that left before its first token


def test_disconnect_during_a_non_streaming_request_aborts_it(server):
    abort_series = 'tokenmill:request_success_total{engine="0",finished_reason="abort",model_name="default"}'
    aborts_before = server.metrics().get(abort_series, 0.0)
    body = {"model": "default", "prompt": "Tell me a long story.", "max_tokens": 500, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):  # the client gives up and closes the connection
        httpx.post(f"{server.url}/v1/completions", json=body, timeout=1.0)

    def aborted_and_freed() -> bool:
        metrics = server.metrics()
        return (
            metrics[abort_series] == aborts_before + 1
            and metrics["tokenmill:num_requests_running"] == 0
            and metrics["tokenmill:kv_cache_used_blocks"] == 0
        )

    assert wait_for(aborted_and_freed, timeout=10), server.metrics()


def test_a_long_prompt_counts_as_running_from_its_first_chunk(server):
    # ~1,000 tokens: several CPU steps of chunked prefill (256 tokens a step on the test server).
    prompt = [1000 + (i * 7) % 5000 for i in range(1000)]
    body = {"model": "default", "prompt": prompt, "max_tokens": 1, "temperature": 0}
    tokens_before = server.metrics().get("tokenmill:generation_tokens_total", 0.0)

    def prefilling() -> bool:
        metrics = server.metrics()
        running = metrics.get("tokenmill:num_requests_running") == 1
        return running and metrics.get("tokenmill:generation_tokens_total", 0.0) == tokens_before

    sender = threading.Thread(
        target=lambda: httpx.post(f"{server.url}/v1/completions", json=body, timeout=120).raise_for_status()
    )
    sender.start()
    try:
        assert wait_for(prefilling, timeout=30, interval=0.05), "the prefilling request was not counted"
    finally:
        sender.join()
    assert server.metrics()["tokenmill:generation_tokens_total"] == tokens_before + 1


def test_a_short_request_is_answered_while_a_long_prompt_prefills(server):
    prompt = [1000 + (i * 11) % 5000 for i in range(1000)]
    long_body = {"model": "default", "prompt": prompt, "max_tokens": 1, "temperature": 0}
    finished: dict[str, float] = {}

    def send_long() -> None:
        httpx.post(f"{server.url}/v1/completions", json=long_body, timeout=120).raise_for_status()
        finished["long"] = time.monotonic()

    sender = threading.Thread(target=send_long)
    sender.start()
    try:
        assert wait_for(lambda: server.metrics().get("tokenmill:num_requests_running") == 1, interval=0.05)
        start = time.monotonic()
        short = {"model": "default", "prompt": "Hi", "max_tokens": 1, "temperature": 0}
        httpx.post(f"{server.url}/v1/completions", json=short, timeout=60).raise_for_status()
        answered = time.monotonic()
    finally:
        sender.join()
    # Answered within a couple of CPU steps, not after the whole prompt: the long one ends later, or in the
    # same step when the short one came in with its last chunk (their answers then cross within
    # milliseconds in either order; a short request held back would come a whole step, ~0.5 s, after).
    # The absolute bound is only a sanity check: a step's time moves with the machine's load (3.4 s once
    # beside another test worker on two cores), the order of the answers does not.
    assert answered - start < 15.0
    assert answered < finished["long"] + 0.1
