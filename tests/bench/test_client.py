"""The streaming client: payloads, SSE parsing, token counting fallbacks, error messages."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from tokenmill.bench.client import RequestInput, RequestResult, build_payload, send_request

from .fake_openai_server import FakeOpenAIServer, Script


def _send(
    server: FakeOpenAIServer, request_kwargs: dict, *, headers: dict | None = None, tokenizer=None
) -> RequestResult:
    endpoint = "/v1/chat/completions" if request_kwargs.get("chat") else "/v1/completions"
    request = RequestInput(api_url=server.base_url + endpoint, model="fake-model", **request_kwargs)

    async def go() -> RequestResult:
        async with aiohttp.ClientSession() as session:
            return await send_request(session, request, headers=headers, tokenizer=tokenizer)

    return asyncio.run(go())


def test_completions_payload_asks_for_a_usage_chunk() -> None:
    request = RequestInput(
        api_url="u",
        model="m",
        prompt=[5, 6, 7],
        prompt_len=3,
        max_tokens=9,
        ignore_eos=True,
        extra_body={"temperature": 0.5, "top_k": 4},
    )
    assert build_payload(request) == {
        "model": "m",
        "max_tokens": 9,
        "stream": True,
        "stream_options": {"include_usage": True},
        "prompt": [5, 6, 7],
        "ignore_eos": True,
        "temperature": 0.5,
        "top_k": 4,
    }
    # No sampling knob unless given: the server's defaults apply, as with vLLM's client.
    plain = RequestInput(api_url="u", model="m", prompt="x", prompt_len=1, max_tokens=2)
    assert "temperature" not in build_payload(plain)


def test_chat_payload_wraps_the_prompt_as_a_user_message() -> None:
    request = RequestInput(api_url="u", model="m", prompt="hi", prompt_len=1, max_tokens=2, chat=True)
    payload = build_payload(request)
    assert payload["messages"] == [{"role": "user", "content": "hi"}]
    assert "prompt" not in payload and "ignore_eos" not in payload
    assert payload["max_completion_tokens"] == 2 and "max_tokens" not in payload
    turns = ({"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"})
    chat = RequestInput(api_url="u", model="m", prompt="be brief\nhi", prompt_len=3, max_tokens=2, chat=True,
                        messages=turns)  # fmt: skip
    assert build_payload(chat)["messages"] == list(turns)  # a conversation goes as its turns


def test_chat_rejects_token_id_prompts() -> None:
    request = RequestInput(api_url="u", model="m", prompt=[1, 2], prompt_len=2, max_tokens=2, chat=True)
    with pytest.raises(ValueError, match="prompts-as-token-ids"):
        build_payload(request)


def test_counts_usage_tokens_text_and_prompt_length(fake_server) -> None:
    server = fake_server(lambda payload: Script(ttft_s=0.01, itl_s=0.005, num_tokens=3))
    result = _send(server, {"prompt": "a b c d", "prompt_len": 99, "max_tokens": 3}, headers={"X-Test": "1"})
    assert result.success and result.error == ""
    assert result.output_tokens == 3
    assert result.prompt_len == 4  # the server's usage wins over the dataset's count
    assert result.generated_text == " t0 t1 t2"
    assert len(result.itl) == 2
    assert result.tpot == pytest.approx((result.latency - result.ttft) / 2)
    assert server.headers[0]["X-Test"] == "1"


def test_chat_role_delta_is_not_the_first_token(fake_server) -> None:
    server = fake_server(lambda payload: Script(ttft_s=0.08, itl_s=0.01, num_tokens=2))
    result = _send(server, {"prompt": "hello", "prompt_len": 1, "max_tokens": 2, "chat": True})
    assert result.success
    assert result.ttft == pytest.approx(0.08, abs=0.01)
    assert result.generated_text == " t0 t1"


def test_without_usage_output_tokens_come_from_the_tokenizer_or_the_chunks(
    fake_server, tiny_tokenizer
) -> None:
    server = fake_server(lambda payload: Script(ttft_s=0.0, itl_s=0.0, num_tokens=5, send_usage=False))
    by_chunks = _send(server, {"prompt": "x", "prompt_len": 7, "max_tokens": 5})
    assert by_chunks.output_tokens == 5 and by_chunks.prompt_len == 7
    by_tokenizer = _send(server, {"prompt": "x", "prompt_len": 7, "max_tokens": 5}, tokenizer=tiny_tokenizer)
    assert by_tokenizer.output_tokens == len(tiny_tokenizer.encode(" t0 t1 t2 t3 t4"))


def test_single_token_answer_has_no_tpot() -> None:
    result = RequestResult(success=True, ttft=0.1, latency=0.1, output_tokens=1)
    assert result.tpot is None


def test_error_messages_from_json_and_plain_bodies(fake_server) -> None:
    server = fake_server(lambda payload: Script(status=503, message="overloaded, retry later"))
    result = _send(server, {"prompt": "x", "prompt_len": 1, "max_tokens": 2})
    assert not result.success and result.error == "HTTP 503: overloaded, retry later"

    request = RequestInput(
        api_url=server.base_url + "/v1/nope", model="m", prompt="x", prompt_len=1, max_tokens=2
    )

    async def go() -> RequestResult:
        async with aiohttp.ClientSession() as session:
            return await send_request(session, request)

    assert asyncio.run(go()).error == "HTTP 404: 404: Not Found"
