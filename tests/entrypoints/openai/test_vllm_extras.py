"""vLLM's request extras the server carries to the engine: cache_salt (prefix-cache isolation), priority
(under --scheduling-policy priority; a 400 otherwise) and prompt_logprobs (equal to the offline engine's),
through the official openai client's extra_body."""

from __future__ import annotations

import asyncio
import uuid

import openai
import pytest

from tokenmill import SamplingParams

from ..conftest import one_thread
from .conftest import MAIN_SERVER_ARGS, ServerProcess
from .test_api_server import assert_error

MESSAGES = [{"role": "user", "content": "Name a primary color."}]


def test_cache_salt_keeps_tenants_apart(client):
    """Prompts sharing a long prefix share its blocks only under the same salt (both unsalted too)."""
    prefix = f"{uuid.uuid4().hex} is a prefix long enough to fill several blocks of the prefix cache. " * 3

    def cached(suffix: str, salt: str | None) -> int:
        result = client.completions.create(
            model="default",
            prompt=prefix + suffix,
            max_tokens=1,
            extra_body={"cache_salt": salt} if salt else None,
        )
        return result.usage.prompt_tokens_details.cached_tokens

    assert cached("One", "tenant-a") == 0
    assert cached("Two", "tenant-b") == 0  # a's blocks hold the same tokens, under another salt
    assert cached("Three", None) == 0
    assert cached("Four", "tenant-a") >= 48
    assert cached("Five", "tenant-b") >= 48
    assert cached("Six", None) >= 48


def test_chat_cache_salt(client):
    system = {"role": "system", "content": f"{uuid.uuid4().hex}: answer in one short sentence. " * 6}

    def cached(question: str, salt: str) -> int:
        messages = [system, {"role": "user", "content": question}]
        result = client.chat.completions.create(
            model="default", messages=messages, max_tokens=1, extra_body={"cache_salt": salt}
        )
        return result.usage.prompt_tokens_details.cached_tokens

    assert cached("Why?", "tenant-a") == 0
    assert cached("How?", "tenant-b") == 0
    assert cached("When?", "tenant-a") >= 48


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_bad_extras_are_400(server, path):
    body = {"model": "default", "max_tokens": 2}
    body |= {"prompt": "Hi"} if path == "/v1/completions" else {"messages": MESSAGES}
    assert_error(server.post(path, json={**body, "cache_salt": ""}), 400, "cache_salt")
    # vLLM's rule: a priority other than 0 needs --scheduling-policy priority.
    error = assert_error(server.post(path, json={**body, "priority": 1}), 400, "priority")
    assert "--scheduling-policy priority" in error["message"]
    assert server.post(path, json={**body, "priority": 0}).status_code == 200
    for k in (21, -2):  # the server's most is 20, as its logprobs'
        assert_error(server.post(path, json={**body, "prompt_logprobs": k}), 400, "prompt_logprobs")
    error = assert_error(server.post(path, json={**body, "prompt_logprobs": -1}), 400, "prompt_logprobs")
    assert "whole vocabulary" in error["message"]
    streamed = {**body, "stream": True}
    error = assert_error(server.post(path, json={**streamed, "prompt_logprobs": 1}), 400, "prompt_logprobs")
    assert error["message"].endswith("`prompt_logprobs` are not available when `stream=True`.")
    assert server.post(path, json={**streamed, "prompt_logprobs": 0}).status_code == 200  # asks for nothing


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_allowed_token_ids_restrict_what_is_sampled(server, default_llm, path):
    """vLLM's allowed_token_ids: every sampled token is one of them; the logprobs of the tokens they
    forbid are reported at the floor, so the response stays JSON."""
    words = (" red", " green", " blue")
    allowed = [default_llm.get_tokenizer().encode(word, add_special_tokens=False)[0] for word in words]
    body = {"model": "default", "max_tokens": 6, "temperature": 1.0, "seed": 3, "allowed_token_ids": allowed}
    if path == "/v1/completions":
        body |= {"prompt": "Hi", "logprobs": 5}
    else:
        body |= {"messages": MESSAGES, "logprobs": True, "top_logprobs": 5}
    response = server.post(path, json=body)
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    text = choice["text"] if path == "/v1/completions" else choice["message"]["content"]
    assert text.split() and set(text.split()) <= {word.strip() for word in words}
    if path == "/v1/completions":
        reported = [lp for entry in choice["logprobs"]["top_logprobs"] for lp in entry.values()]
    else:
        content = choice["logprobs"]["content"]
        reported = [top["logprob"] for entry in content for top in entry["top_logprobs"]]
    assert reported and all(lp >= -9999.0 for lp in reported)


def offline_prompt_logprobs(default_llm, prompt_ids: list[int], k: int) -> list:
    with one_thread():  # as the server's core: same kernels, same rounding
        (offline,) = default_llm.generate(
            prompt_token_ids=[prompt_ids],
            sampling_params=SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=k),
            use_tqdm=False,
        )
    return offline.prompt_logprobs


def assert_vllm_shape(reported: list, offline: list, prompt_ids: list[int], k: int) -> None:
    """vLLM's prompt_logprobs: None first, then {token_id: {logprob, rank, decoded_token}} of the prompt
    token and the top k, equal to what the offline engine computes."""
    assert len(reported) == len(prompt_ids) and reported[0] is None and offline[0] is None
    for token_id, entry, want in zip(prompt_ids[1:], reported[1:], offline[1:]):
        assert next(iter(entry)) == str(token_id)  # the prompt token first, then its alternatives
        assert set(entry) == {str(t) for t in want}
        assert len(want) <= k + 1
        for t, lp in want.items():
            got = entry[str(t)]
            assert got["logprob"] == pytest.approx(lp.logprob, abs=1e-4)
            assert got["rank"] == lp.rank and got["decoded_token"] == lp.decoded_token


def test_completion_prompt_logprobs_equal_the_offline_engines(server, client, default_llm):
    prompt = "The three primary colors are red, yellow and"
    prompt_ids = server.post("/tokenize", json={"prompt": prompt}).json()["tokens"]
    result = client.completions.create(
        model="default", prompt=prompt, max_tokens=2, temperature=0, n=2, extra_body={"prompt_logprobs": 3}
    )
    offline = offline_prompt_logprobs(default_llm, prompt_ids, 3)
    for choice in result.choices:  # every choice carries its prompt's
        assert_vllm_shape(choice.prompt_logprobs, offline, prompt_ids, 3)
    # Beside echo's logprobs (1 alternative) the engine scores the most asked for; each field gets its own.
    echoed = client.completions.create(
        model="default", prompt=prompt, max_tokens=1, echo=True, logprobs=1, extra_body={"prompt_logprobs": 3}
    ).choices[0]
    assert_vllm_shape(echoed.prompt_logprobs, offline, prompt_ids, 3)
    assert all(len(top) <= 2 for top in echoed.logprobs.top_logprobs[1 : len(prompt_ids)])
    plain = client.completions.create(model="default", prompt=prompt, max_tokens=1)
    assert getattr(plain.choices[0], "prompt_logprobs", None) is None


def test_chat_prompt_logprobs_equal_the_offline_engines(server, client, default_llm):
    prompt_ids = server.post("/tokenize", json={"messages": MESSAGES}).json()["tokens"]
    result = client.chat.completions.create(
        model="default", messages=MESSAGES, max_tokens=1, extra_body={"prompt_logprobs": 0}
    )
    # vLLM's chat reports them beside the choices, once per response.
    assert_vllm_shape(
        result.prompt_logprobs, offline_prompt_logprobs(default_llm, prompt_ids, 0), prompt_ids, 0
    )


@pytest.fixture(scope="module", autouse=True)
def priority_server_process(tmp_path_factory):
    """Started as the module starts, so it boots on the core the tests before its own leave idle (the
    shared server and the offline engine run one torch thread)."""
    args = [*MAIN_SERVER_ARGS, "--scheduling-policy", "priority", "--max-num-seqs", "1"]
    process = ServerProcess(args, tmp_path_factory.mktemp("priority") / "server.log")
    try:
        yield process
    finally:
        process.stop()


@pytest.fixture(scope="module")
def priority_server(priority_server_process):
    """One request at a time, so the waiting queue's order is the order requests run in."""
    return priority_server_process.wait_ready()


def test_priority_orders_the_waiting_queue(priority_server):
    """Behind a running request, a lower priority value that arrived later runs first."""
    client = priority_server.async_client()
    finished: list[str] = []

    async def waiting(name: str, priority: int) -> None:
        await client.completions.create(
            model="default", prompt=name, max_tokens=2, extra_body={"priority": priority, "ignore_eos": True}
        )
        finished.append(name)

    async def run() -> None:
        running = await client.completions.create(
            model="default", prompt="Count:", max_tokens=64, stream=True, extra_body={"ignore_eos": True}
        )
        tasks: list[asyncio.Task] = []
        async for _ in running:
            if not tasks:  # the long request holds the one seat
                tasks.append(asyncio.create_task(waiting("late", 5)))
                await asyncio.sleep(0.3)
                tasks.append(asyncio.create_task(waiting("urgent", -1)))
        await asyncio.gather(*tasks)

    asyncio.run(run())
    assert finished == ["urgent", "late"]
    with pytest.raises(openai.BadRequestError):  # priorities are ints, as vLLM's
        priority_server.client().completions.create(
            model="default", prompt="x", max_tokens=1, extra_body={"priority": "high"}
        )
