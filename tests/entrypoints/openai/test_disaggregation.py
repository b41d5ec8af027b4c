"""Prefill/decode disaggregation with two real servers (CPU, embedded SmolLM2, fp32, the ZMQ path):
`serve --kv-role prefill` and `serve --kv-role decode --kv-peer ...`. Through the decode instance, the
openai client gets the tokens one instance gives, streamed or not, chat and completions; the decode
instance computes no prompt token of a long prompt (short ones it prefills itself); no block is left
held on either side; a KV that never comes fails its request with a clear error and frees its blocks;
a prefill peer that dies fails only the requests that needed it."""

from __future__ import annotations

from pathlib import Path

import openai
import pytest

from tests.entrypoints.openai.conftest import MAIN_SERVER_ARGS, ServerProcess, free_port, wait_for

SYSTEM = "You are a careful assistant. " + " ".join(f"Rule {k}: be brief about item {k}." for k in range(12))


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory):
    logs = tmp_path_factory.mktemp("disagg")
    prefill = ServerProcess(
        [*MAIN_SERVER_ARGS, "--kv-role", "prefill", "--kv-port", str(free_port())], logs / "prefill.log"
    )
    try:
        # Both boot at once (the decode instance reaches its peer only when a request needs it).
        decode = ServerProcess(
            [*MAIN_SERVER_ARGS, "--kv-role", "decode", "--kv-peer", f"127.0.0.1:{prefill.port}",
             "--remote-prefill-min-tokens", "32"],
            logs / "decode.log",
        )  # fmt: skip
        try:
            prefill.wait_ready()
            yield prefill, decode.wait_ready()
        finally:
            decode.stop()
    finally:
        prefill.stop()


def counter(server: ServerProcess, name: str) -> float:
    return server.metrics().get(f"tokenmill:{name}", 0.0)


def test_decode_instance_gives_one_instances_tokens_without_prefilling(pair) -> None:
    prefill, decode = pair
    reference, client = prefill.client(), decode.client()  # the prefill server also serves plainly
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "List three fruits."}]
    kwargs = {"model": "default", "messages": messages, "max_tokens": 12, "temperature": 0}
    want = reference.chat.completions.create(**kwargs).choices[0].message.content
    assert client.chat.completions.create(**kwargs).choices[0].message.content == want
    streamed = client.chat.completions.create(**kwargs, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == want
    prompt = SYSTEM + " Now count: one, two,"
    completion = {"model": "default", "prompt": prompt, "max_tokens": 8, "temperature": 0}
    want_text = reference.completions.create(**completion).choices[0].text
    assert client.completions.create(**completion).choices[0].text == want_text
    # Three requests came with their KV; the decode instance looked up no prompt in its own cache.
    assert wait_for(lambda: counter(decode, "kv_transfer_requests_total") == 3)
    assert counter(prefill, "kv_transfer_requests_total") == 3
    assert counter(decode, "prefix_cache_queries_total") == 0
    assert counter(decode, "kv_transfer_bytes_total") == counter(prefill, "kv_transfer_bytes_total") > 0
    # A short prompt is prefilled where it lands.
    short = client.completions.create(model="default", prompt="Hi there", max_tokens=3, temperature=0)
    assert (
        short.choices[0].text
        == reference.completions.create(model="default", prompt="Hi there", max_tokens=3, temperature=0)
        .choices[0]
        .text
    )
    assert wait_for(lambda: counter(decode, "prefix_cache_queries_total") > 0)
    # Nothing is left held: every block free again on both sides.
    assert wait_for(lambda: counter(prefill, "kv_cache_used_blocks") == 0)
    assert wait_for(lambda: counter(decode, "kv_cache_used_blocks") == 0)


def test_remote_decode_asks_are_checked(pair) -> None:
    prefill, decode = pair
    body = {
        "model": "default",
        "prompt": "x",
        "max_tokens": 1,
        "kv_transfer_params": {"do_remote_decode": True},
    }
    answer = prefill.post("/v1/completions", json=body)
    assert answer.status_code == 200 and answer.json()["kv_transfer_params"]["first_token_id"] >= 0
    assert wait_for(lambda: counter(prefill, "kv_cache_used_blocks") == 0, timeout=1) is False  # held
    refused = decode.post("/v1/completions", json=body)  # not a prefill instance
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "kv_transfer_params"


def test_a_dead_prefill_peer_fails_only_the_requests_that_need_it(pair) -> None:
    """Last in the module: it kills the shared prefill instance."""
    prefill, decode = pair
    client = decode.client()
    core = prefill.core_pid()
    prefill.proc.kill()
    prefill.proc.wait()
    with pytest.raises(openai.APIStatusError) as failure:
        client.completions.create(model="default", prompt=SYSTEM, max_tokens=4)
    assert failure.value.status_code == 503 and "prefill peer" in str(failure.value)
    # A short prompt never needed the peer; the decode instance keeps serving.
    assert client.completions.create(model="default", prompt="Hello", max_tokens=2).choices[0].text
    assert wait_for(lambda: counter(decode, "kv_cache_used_blocks") == 0)
    # Its engine core saw its parent go and exited, KV socket and all (it used to wait on that socket).
    assert wait_for(lambda: not Path(f"/proc/{core}").exists(), timeout=20)
