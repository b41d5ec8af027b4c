"""The server's life under stress: API keys, a full waiting queue (429), SIGTERM draining (exit 0) and the
engine-core process dying (requests fail fast, /health 503, exit 1). Random weights: only behaviour counts."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
import time

import httpx
import openai
import pytest

from .conftest import ServerProcess, wait_for

API_KEY = "test-secret"
DUMMY_ARGS = [
    "--model",
    "default",
    "--load-format",
    "dummy",
    "--max-model-len",
    "256",
    "--num-kv-blocks",
    "64",
]
MESSAGES = [{"role": "user", "content": "Go on forever."}]


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """(a server with an API key, one running sequence and a waiting cap of one; a server to kill; one with a
    shutdown timeout of one second)."""
    log_dir = tmp_path_factory.mktemp("lifecycle")
    small = ServerProcess(
        [
            *DUMMY_ARGS,
            "--max-num-seqs",
            "1",
            "--max-waiting-requests",
            "1",
            "--drain-timeout",
            "60",
            "--max-request-body-bytes",
            "4096",
        ],  # fmt: skip
        log_dir / "small.log",
        api_key=API_KEY,
    )
    doomed = ServerProcess(DUMMY_ARGS, log_dir / "doomed.log")
    # test_shutdown_timeout_bounds_the_whole_shutdown's, booted beside these two and ready before any test
    # runs, so no boot competes with the timed tests for the CPU.
    bounded = ServerProcess([*DUMMY_ARGS, "--shutdown-timeout", "1"], log_dir / "bounded.log")
    try:
        yield small.wait_ready(), doomed.wait_ready(), bounded.wait_ready()
    finally:
        small.stop()
        doomed.stop()
        bounded.stop()


def long_stream(client: openai.OpenAI, max_tokens: int = 200):
    """A streaming request that runs for a while; returns it once its first token has arrived."""
    stream = client.chat.completions.create(
        model="default",
        messages=MESSAGES,
        max_tokens=max_tokens,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            return stream
    raise AssertionError("stream ended before its first token")


def test_api_key_is_required_everywhere_but_probes_and_metrics(servers):
    small, *_ = servers
    for path, body in (
        ("/tokenize", {"prompt": "a"}),
        ("/detokenize", {"tokens": [1]}),
        ("/reset_prefix_cache", None),
    ):
        response = httpx.post(f"{small.url}{path}", json=body)
        assert response.status_code == 401, path
        assert response.json()["error"]["code"] == "invalid_api_key"
    lowercase = httpx.post(
        f"{small.url}/tokenize", json={"prompt": "a"}, headers={"Authorization": f"bearer {API_KEY}"}
    )
    assert lowercase.status_code == 200 and lowercase.json()["count"] >= 1
    wrong = httpx.post(f"{small.url}/tokenize", json={"prompt": "a"}, headers={"Authorization": "Basic x"})
    assert wrong.status_code == 401
    for path in ("/health", "/version", "/metrics"):
        assert httpx.get(f"{small.url}{path}").status_code == 200, path


def test_bodies_over_the_cap_are_413_and_the_server_keeps_serving(servers):
    small, *_ = servers
    auth = {"Authorization": f"Bearer {API_KEY}"}
    big = {"model": "default", "prompt": "word " * 2000, "max_tokens": 1}
    response = httpx.post(f"{small.url}/v1/completions", json=big, headers=auth)
    assert response.status_code == 413
    error = response.json()["error"]
    assert error["code"] == "request_too_large" and "4096 bytes" in error["message"]

    def chunked():  # no Content-Length: counted as it arrives
        yield b'{"model": "default", "prompt": "'
        for _ in range(100):
            yield b"word " * 20
        yield b'"}'

    response = httpx.post(
        f"{small.url}/v1/completions", content=chunked(), headers={**auth, "content-type": "application/json"}
    )
    assert response.status_code == 413 and "4096 bytes" in response.json()["error"]["message"]
    ok = httpx.post(f"{small.url}/tokenize", json={"prompt": "a few words"}, headers=auth)
    assert ok.status_code == 200 and httpx.get(f"{small.url}/health").status_code == 200


def test_api_key_is_required_on_v1(servers):
    small, *_ = servers
    with pytest.raises(openai.AuthenticationError) as caught:
        small.client(api_key="wrong").models.list()
    assert caught.value.status_code == 401 and caught.value.body["code"] == "invalid_api_key"
    response = httpx.post(f"{small.url}/v1/completions", json={"prompt": "a"})
    assert response.status_code == 401 and response.json()["error"]["type"] == "invalid_request_error"
    assert httpx.get(f"{small.url}/health").status_code == 200  # probes need no key
    assert [m.id for m in small.client().models.list().data] == ["default"]


def test_full_waiting_queue_is_429(servers):
    small, *_ = servers
    client = small.client()
    running = long_stream(client)  # the one running sequence
    waiting = client.chat.completions.create(
        model="default", messages=MESSAGES, max_tokens=200, stream=True, extra_body={"ignore_eos": True}
    )
    next(iter(waiting))  # the role chunk: admitted, and waiting for the running one
    with pytest.raises(openai.RateLimitError) as caught:
        client.chat.completions.create(model="default", messages=MESSAGES, max_tokens=2)
    assert caught.value.status_code == 429 and caught.value.body["code"] == "queue_full"
    running.close()
    waiting.close()

    def idle() -> bool:
        metrics = small.metrics()
        return metrics["tokenmill:num_requests_running"] == metrics["tokenmill:num_requests_waiting"] == 0

    assert wait_for(idle), small.metrics()  # both disconnects were seen and aborted
    result = client.completions.create(
        model="default", prompt="a", max_tokens=2, extra_body={"ignore_eos": True}
    )
    assert result.usage.completion_tokens == 2


def test_sigterm_drains_running_requests_then_exits_0(servers):
    small, *_ = servers
    client = small.client()
    stream = long_stream(client, max_tokens=40)
    small.proc.send_signal(signal.SIGTERM)
    health = wait_for(lambda: httpx.get(f"{small.url}/health").status_code == 503, timeout=10)
    assert health, "health did not turn 503 while draining"
    assert httpx.get(f"{small.url}/health").json()["error"]["code"] == "draining"
    with pytest.raises(openai.APIStatusError) as caught:
        client.completions.create(model="default", prompt="a", max_tokens=2)
    assert caught.value.status_code == 503 and caught.value.body["code"] == "draining"
    chunks = list(stream)  # the running request still finishes, in full
    assert chunks[-1].choices[0].finish_reason == "length"
    assert small.proc.wait(60) == 0, small.log_text()[-2000:]


def test_engine_death_fails_requests_fast_and_exits_nonzero(servers):
    _, doomed, _ = servers
    client = doomed.client()
    non_streaming: dict[str, object] = {}

    def blocking_request() -> None:
        try:
            client.chat.completions.create(
                model="default", messages=MESSAGES, max_tokens=200, extra_body={"ignore_eos": True}
            )
        except openai.APIStatusError as exc:
            non_streaming["error"] = exc
            non_streaming["at"] = time.monotonic()

    body = {"model": "default", "messages": MESSAGES, "max_tokens": 200, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", f"{doomed.url}/v1/chat/completions", json=body, timeout=60) as response:
        lines = response.iter_lines()
        for line in lines:  # wait for the first token
            if line.startswith("data: {") and json.loads(line[6:])["choices"][0]["delta"].get("content"):
                break
        thread = threading.Thread(target=blocking_request)
        thread.start()
        time.sleep(0.5)  # let it reach the engine
        os.kill(doomed.core_pid(), signal.SIGKILL)
        killed_at = time.monotonic()

        assert wait_for(
            lambda: httpx.get(f"{doomed.url}/health").status_code == 503, timeout=2, interval=0.05
        )
        assert httpx.get(f"{doomed.url}/health").json()["error"]["code"] == "engine_dead"
        rest = [line for line in lines if line]
    # The stream began with 200, so the failure travels as an error event, then [DONE].
    assert rest[-1] == "data: [DONE]"
    error = json.loads(rest[-2].removeprefix("data: "))["error"]
    assert error["code"] == "engine_dead" and "engine core" in error["message"]
    thread.join(10)
    assert isinstance(non_streaming.get("error"), openai.APIStatusError)
    assert non_streaming["error"].status_code == 503
    assert non_streaming["at"] - killed_at < 3  # fails fast instead of waiting for 200 tokens
    assert doomed.proc.wait(30) == 1, doomed.log_text()[-2000:]


def test_shutdown_timeout_bounds_the_whole_shutdown(servers):
    server = servers[2]  # its own: --shutdown-timeout 1, and this test stops it
    try:
        stream = long_stream(server.client(), max_tokens=220)  # far longer than 1 s on this CPU
        start = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(30) == 0, server.log_text()[-2000:]
        took = time.monotonic() - start
        # One second of drain, then the open request is aborted and the rest stops within ~1.5 s.
        assert 1.0 <= took < 4.5, took
        with contextlib.suppress(openai.APIError, httpx.HTTPError):
            for _ in stream:
                pass
        assert "drain timeout: aborting 1 open requests" in server.log_text()
    finally:
        server.stop()
