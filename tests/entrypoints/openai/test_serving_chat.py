"""/v1/chat/completions through the official openai client against the real server."""

from __future__ import annotations

import json

import pytest

from .conftest import MODEL_NAMES

MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


def chat_prompt_tokens(server, messages) -> int:
    return server.post("/tokenize", json={"messages": messages}).json()["count"]


@pytest.fixture(scope="module")
def greedy(client):
    """The greedy reply to MESSAGES, 12 tokens at most."""
    return client.chat.completions.create(model="default", messages=MESSAGES, max_tokens=12, temperature=0)


def test_non_streaming_chat_and_usage_match_the_tokenizer(server, greedy):
    choice = greedy.choices[0]
    assert greedy.object == "chat.completion" and greedy.model == "default"
    assert greedy.id.startswith("chatcmpl-")
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason in ("stop", "length")
    usage = greedy.usage
    assert usage.prompt_tokens == chat_prompt_tokens(server, MESSAGES)
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert 1 <= usage.completion_tokens <= 12
    if choice.finish_reason == "length":
        assert usage.completion_tokens == 12
    assert usage.prompt_tokens_details.cached_tokens % 16 == 0  # whole blocks of the prefix cache


def test_second_identical_request_hits_the_prefix_cache(client, greedy):
    again = client.chat.completions.create(model="smollm2", messages=MESSAGES, max_tokens=12, temperature=0)
    assert again.model == "smollm2"  # either served name works and is echoed back
    assert again.choices[0].message.content == greedy.choices[0].message.content
    prompt_tokens = again.usage.prompt_tokens
    assert again.usage.prompt_tokens_details.cached_tokens == (prompt_tokens - 1) // 16 * 16


def test_streaming_chat_chunks(client, greedy):
    stream = client.chat.completions.create(
        model="default",
        messages=MESSAGES,
        max_tokens=12,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    first, *middle, finish, usage_chunk = chunks
    assert first.choices[0].delta.role == "assistant" and first.choices[0].delta.content == ""
    assert all(c.object == "chat.completion.chunk" and c.id == first.id for c in chunks)
    assert all(c.choices[0].finish_reason is None and c.choices[0].delta.content for c in middle)
    assert "".join(c.choices[0].delta.content for c in middle) == greedy.choices[0].message.content
    assert finish.choices[0].finish_reason == greedy.choices[0].finish_reason
    assert not finish.choices[0].delta.content
    assert usage_chunk.choices == []
    assert usage_chunk.usage.completion_tokens == greedy.usage.completion_tokens
    assert usage_chunk.usage.prompt_tokens == greedy.usage.prompt_tokens


def test_raw_stream_with_include_usage_sends_null_usage_until_the_last_chunk(server):
    body = {"model": "default", "messages": MESSAGES, "max_tokens": 3, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    lines = [line for line in server.post("/v1/chat/completions", json=body).text.split("\n\n") if line]
    payloads = [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]
    assert all(p["usage"] is None for p in payloads[:-1])
    assert payloads[-1]["usage"]["completion_tokens"] == 3 and payloads[-1]["choices"] == []


def test_raw_stream_ends_with_done_and_omits_usage_unless_asked(server):
    body = {"model": "default", "messages": MESSAGES, "max_tokens": 3, "temperature": 0, "stream": True}
    lines = [line for line in server.post("/v1/chat/completions", json=body).text.split("\n\n") if line]
    assert lines[-1] == "data: [DONE]"
    payloads = [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]
    assert all("usage" not in p for p in payloads)
    assert payloads[-1]["choices"][0]["finish_reason"] is not None


def test_stop_string_cuts_the_text(client, greedy):
    text = greedy.choices[0].message.content
    words = text.split(" ")
    assert len(words) >= 3, text
    stop = " " + words[2]
    result = client.chat.completions.create(
        model="default", messages=MESSAGES, max_tokens=12, temperature=0, stop=[stop]
    )
    assert result.choices[0].message.content == text[: text.index(stop)]
    assert result.choices[0].finish_reason == "stop"
    assert result.model_extra is not None and result.choices[0].model_extra["stop_reason"] == stop


def test_stop_string_in_stream_is_never_half_sent(client, greedy):
    text = greedy.choices[0].message.content
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    stream = client.chat.completions.create(
        model="default", messages=MESSAGES, max_tokens=12, temperature=0, stop=stop, stream=True
    )
    streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert streamed == text[: text.index(stop)]


def test_n2_and_seed_are_reproducible(client):
    def sample(seed: int):
        result = client.chat.completions.create(
            model="default", messages=MESSAGES, max_tokens=8, temperature=1.0, n=2, seed=seed
        )
        assert [c.index for c in result.choices] == [0, 1]
        assert 2 <= result.usage.completion_tokens <= 16
        return [c.message.content for c in result.choices]

    first = sample(1234)
    assert sample(1234) == first
    assert first[0] != first[1]  # the two samples get seeds 1234 and 1235
    assert sample(99) != first


def test_logprobs_shape(client):
    result = client.chat.completions.create(
        model="default", messages=MESSAGES, max_tokens=4, temperature=0, logprobs=True, top_logprobs=3,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    content = result.choices[0].logprobs.content
    assert len(content) == 4 == result.usage.completion_tokens
    for entry in content:
        assert len(entry.top_logprobs) == 3
        ranked = [t.logprob for t in entry.top_logprobs]
        assert ranked == sorted(ranked, reverse=True)
        # Greedy: the chosen token is the likeliest one.
        assert entry.token == entry.top_logprobs[0].token and entry.logprob == pytest.approx(ranked[0])
        assert entry.bytes == list(entry.token.encode())
    assert "".join(e.token for e in content) == result.choices[0].message.content


def test_logprobs_without_top_logprobs(client):
    result = client.chat.completions.create(
        model="default", messages=MESSAGES, max_tokens=2, temperature=0, logprobs=True
    )
    assert [len(e.top_logprobs) for e in result.choices[0].logprobs.content] == [0] * len(
        result.choices[0].logprobs.content
    )


def test_max_completion_tokens_and_extras(client):
    result = client.chat.completions.create(
        model="default",
        messages=MESSAGES,
        max_completion_tokens=5,
        temperature=0.8,
        top_p=0.9,
        presence_penalty=0.5,
        frequency_penalty=0.5,
        seed=3,
        extra_body={
            "top_k": 20,
            "min_p": 0.05,
            "repetition_penalty": 1.2,
            "ignore_eos": True,
            "min_tokens": 5,
        },
    )
    assert result.usage.completion_tokens == 5
    assert result.choices[0].finish_reason == "length"


def test_logit_bias_forces_a_token(server, client):
    token_id = server.post("/tokenize", json={"prompt": " Paris", "add_special_tokens": False}).json()[
        "tokens"
    ][0]
    result = client.chat.completions.create(
        model="default", messages=MESSAGES, max_tokens=3, temperature=0, logit_bias={str(token_id): 100},
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    text = server.post("/detokenize", json={"tokens": [token_id] * 3}).json()["prompt"]
    assert result.choices[0].message.content == text


def test_stop_token_ids(server, client, greedy):
    text = greedy.choices[0].message.content
    tokens = server.post("/tokenize", json={"prompt": text, "add_special_tokens": False}).json()["tokens"]
    result = client.chat.completions.create(
        model="default",
        messages=MESSAGES,
        max_tokens=12,
        temperature=0,
        extra_body={"stop_token_ids": [tokens[1]]},
    )
    assert result.choices[0].finish_reason == "stop"
    assert result.choices[0].model_extra["stop_reason"] == tokens[1]
    assert result.usage.completion_tokens == 2


def test_both_served_names_are_listed(client):
    assert [m.id for m in client.models.list().data] == list(MODEL_NAMES)


def test_the_eos_token_that_ends_a_reply_has_no_logprob(client):
    request = dict(model="default", messages=MESSAGES, max_tokens=200, temperature=0, logprobs=True)
    result = client.chat.completions.create(**request)
    (choice,) = result.choices
    assert choice.finish_reason == "stop"  # the embedded instruct model ends its reply with EOS
    content = choice.logprobs.content
    assert len(content) == result.usage.completion_tokens - 1  # the EOS is counted, not scored
    assert "".join(entry.token for entry in content) == choice.message.content
    streamed = []
    for chunk in client.chat.completions.create(**request, stream=True):
        for c in chunk.choices:
            if c.logprobs is not None:
                assert c.delta.content  # no chunk carries only the EOS's score
                streamed += c.logprobs.content
    assert [e.token for e in streamed] == [e.token for e in content]


def test_chat_template_extras(server, client, default_llm):
    """vLLM's chat extras: continue_final_message leaves the assistant's last message open (the offline
    LLM.chat's tokens), a request's own chat_template with chat_template_kwargs renders the prompt (its
    token count), and each is checked (continue_final_message needs add_generation_prompt false)."""
    from tests.entrypoints.openai.test_api_server import assert_error
    from tokenmill import SamplingParams

    prefill = [
        {"role": "user", "content": "What color is the sky?"},
        {"role": "assistant", "content": "The sky is"},
    ]
    reply = client.chat.completions.create(
        model="default", messages=prefill, max_tokens=6, temperature=0,
        extra_body={"continue_final_message": True, "add_generation_prompt": False},
    ).choices[0]  # fmt: skip
    (offline,) = default_llm.chat(
        [prefill], SamplingParams(max_tokens=6, temperature=0), use_tqdm=False,
        continue_final_message=True, add_generation_prompt=False,
    )  # fmt: skip
    assert reply.message.content == offline.outputs[0].text and reply.message.content
    template = "{% for m in messages %}{{ m['content'] }}{% endfor %}{{ suffix }}"
    plain = client.chat.completions.create(
        model="default", messages=[{"role": "user", "content": "The sky is"}], max_tokens=1,
        extra_body={"chat_template": template, "chat_template_kwargs": {"suffix": " blue and"}},
    )  # fmt: skip
    count = len(
        server.post("/tokenize", json={"prompt": "The sky is blue and", "add_special_tokens": False}).json()[
            "tokens"
        ]
    )
    assert plain.usage.prompt_tokens == count
    body = {"model": "default", "messages": prefill, "max_tokens": 2, "continue_final_message": True}
    assert_error(server.post("/v1/chat/completions", json=body), 400, "continue_final_message")


def test_a_message_name_reaches_the_chat_template(server, client):
    """A message's name goes to the chat template, as vLLM passes it (the embedded template ignores it;
    one that writes it shows it in the prompt)."""
    template = "{% for m in messages %}{{ m['name'] }}: {{ m['content'] }}\n{% endfor %}"
    messages = [{"role": "user", "content": "Hi", "name": "Alice"}]
    reply = client.chat.completions.create(
        model="default", messages=messages, max_tokens=1, extra_body={"chat_template": template}
    )
    tokens = server.post("/tokenize", json={"prompt": "Alice: Hi\n", "add_special_tokens": False}).json()
    assert reply.usage.prompt_tokens == tokens["count"]


def test_add_special_tokens_adds_the_tokenizers_bos_to_a_chat():
    """vLLM's add_special_tokens for chat (false by default): true adds the special tokens a tokenizer
    puts on a text (its BOS) to what the template wrote. The embedded SmolLM2 adds none: a stand-in."""
    from types import SimpleNamespace

    from tokenmill.entrypoints.openai.protocol import ChatCompletionRequest
    from tokenmill.entrypoints.openai.serving_chat import chat_encoder

    class BosTokenizer:
        def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
            return [1] * add_special_tokens + [ord(c) for c in text]

    def own_encoder(text: str) -> list[int]:
        return [ord(c) for c in text]

    state = SimpleNamespace(engine=SimpleNamespace(tokenizer=BosTokenizer()), encode_chat=own_encoder)
    messages = [{"role": "user", "content": "hi"}]
    assert chat_encoder(state, ChatCompletionRequest(messages=messages)) is own_encoder
    encode = chat_encoder(state, ChatCompletionRequest(messages=messages, add_special_tokens=True))
    assert encode("ab") == [1, 97, 98]
