"""/v1/completions through the official openai client, and greedy equality with the offline LLM."""

from __future__ import annotations

import pytest

from tokenmill import SamplingParams

from ..conftest import one_thread

PROMPT = "The three primary colors are"


def tokenize(server, text: str) -> list[int]:
    return server.post("/tokenize", json={"prompt": text}).json()["tokens"]


@pytest.fixture(scope="module")
def greedy(client):
    return client.completions.create(model="default", prompt=PROMPT, max_tokens=10, temperature=0)


def test_completion_and_usage_match_the_tokenizer(server, greedy):
    choice = greedy.choices[0]
    assert greedy.object == "text_completion" and greedy.id.startswith("cmpl-")
    assert choice.index == 0 and choice.text and choice.logprobs is None
    assert greedy.usage.prompt_tokens == len(tokenize(server, PROMPT))
    if choice.finish_reason == "length":
        assert greedy.usage.completion_tokens == 10


def test_greedy_output_equals_llm_generate(server, greedy, default_llm):
    with one_thread():  # the server's core runs one thread too: same kernels, same rounding
        (offline,) = default_llm.generate(
            PROMPT, SamplingParams(temperature=0, max_tokens=10), use_tqdm=False
        )
        (offline_chat,) = default_llm.chat(
            [{"role": "user", "content": "Name a fruit."}],
            SamplingParams(temperature=0, max_tokens=10),
            use_tqdm=False,
        )
    assert greedy.choices[0].text == offline.outputs[0].text
    assert greedy.choices[0].finish_reason == offline.outputs[0].finish_reason
    assert greedy.usage.prompt_tokens == len(offline.prompt_token_ids)
    chat = server.client().chat.completions.create(
        model="default", messages=[{"role": "user", "content": "Name a fruit."}], max_tokens=10, temperature=0
    )
    assert chat.choices[0].message.content == offline_chat.outputs[0].text
    assert chat.usage.completion_tokens == len(offline_chat.outputs[0].token_ids)


def test_token_id_prompt_equals_text_prompt(server, client, greedy):
    result = client.completions.create(
        model="default", prompt=tokenize(server, PROMPT), max_tokens=10, temperature=0
    )
    assert result.choices[0].text == greedy.choices[0].text


def test_prompt_list_numbers_choices_prompt_major(server, client, greedy):
    prompts = [PROMPT, "Water boils at"]
    result = client.completions.create(model="default", prompt=prompts, max_tokens=4, temperature=0, n=2)
    assert [c.index for c in result.choices] == [0, 1, 2, 3]
    texts = [c.text for c in result.choices]
    assert texts[0] == texts[1] == greedy.choices[0].text[: len(texts[0])]  # greedy samples agree
    assert texts[2] == texts[3]
    assert result.usage.prompt_tokens == sum(len(tokenize(server, p)) for p in prompts)
    assert result.usage.completion_tokens == 16


def test_echo_prepends_the_prompt(client, greedy):
    result = client.completions.create(
        model="default", prompt=PROMPT, max_tokens=10, temperature=0, echo=True
    )
    assert result.choices[0].text == PROMPT + greedy.choices[0].text


def test_logprobs_shape(client, greedy):
    result = client.completions.create(
        model="default",
        prompt=PROMPT,
        max_tokens=5,
        temperature=0,
        logprobs=2,
        extra_body={"ignore_eos": True},
    )
    logprobs = result.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == 5
    assert "".join(logprobs.tokens) == result.choices[0].text
    assert logprobs.text_offset == [sum(len(t) for t in logprobs.tokens[:i]) for i in range(5)]
    for token, logprob, top in zip(
        logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs, strict=True
    ):
        assert len(top) == 2 and top[token] == logprob == max(top.values())  # greedy: the likeliest


def test_echo_with_logprobs_scores_the_prompt(server, client, greedy, default_llm):
    prompt_ids = tokenize(server, PROMPT)
    result = client.completions.create(
        model="default",
        prompt=PROMPT,
        max_tokens=3,
        temperature=0,
        echo=True,
        logprobs=2,
        extra_body={"ignore_eos": True},
    )
    choice = result.choices[0]
    logprobs = choice.logprobs
    assert len(logprobs.tokens) == len(prompt_ids) + 3
    assert "".join(logprobs.tokens) == choice.text and choice.text.startswith(PROMPT)
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    assert all(lp <= 0 for lp in logprobs.token_logprobs[1:])
    assert logprobs.text_offset == [
        sum(len(t) for t in logprobs.tokens[:i]) for i in range(len(logprobs.tokens))
    ]
    with one_thread():
        (offline,) = default_llm.generate(
            PROMPT, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=2), use_tqdm=False
        )
    expected = [entry[token].logprob for token, entry in zip(prompt_ids[1:], offline.prompt_logprobs[1:])]
    assert logprobs.token_logprobs[1 : len(prompt_ids)] == pytest.approx(expected, abs=1e-4)

    stream = client.completions.create(
        model="default",
        prompt=PROMPT,
        max_tokens=3,
        temperature=0,
        echo=True,
        logprobs=2,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    tokens, text = [], ""
    for chunk in stream:
        for c in chunk.choices:
            text += c.text
            if c.logprobs is not None:
                tokens += c.logprobs.tokens
    assert text == choice.text and tokens == logprobs.tokens


def test_max_tokens_zero_with_echo_scores_the_prompt_and_generates_nothing(server, client):
    prompt_ids = tokenize(server, PROMPT)
    scoring = dict(model="default", prompt=PROMPT, max_tokens=0, echo=True, logprobs=1)
    result = client.completions.create(**scoring)
    (choice,) = result.choices
    assert choice.text == PROMPT and choice.finish_reason == "length"
    assert len(choice.logprobs.tokens) == len(prompt_ids) and "".join(choice.logprobs.tokens) == PROMPT
    assert choice.logprobs.token_logprobs[0] is None
    assert all(lp <= 0 for lp in choice.logprobs.token_logprobs[1:])
    assert result.usage.completion_tokens == 0 and result.usage.prompt_tokens == len(prompt_ids)
    streamed_text, streamed_tokens = "", []
    for chunk in client.completions.create(**scoring, stream=True):
        for c in chunk.choices:
            streamed_text += c.text
            streamed_tokens += c.logprobs.tokens if c.logprobs is not None else []
    assert streamed_text == PROMPT and streamed_tokens == choice.logprobs.tokens


def test_streaming_completion(client, greedy):
    stream = client.completions.create(
        model="default",
        prompt=PROMPT,
        max_tokens=10,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text_chunks, usage_chunk = chunks[:-1], chunks[-1]
    assert "".join(c.choices[0].text for c in text_chunks) == greedy.choices[0].text
    assert [c.choices[0].finish_reason for c in text_chunks][-1] == greedy.choices[0].finish_reason
    assert all(c.choices[0].finish_reason is None for c in text_chunks[:-1])
    assert usage_chunk.choices == [] and usage_chunk.usage.completion_tokens == greedy.usage.completion_tokens


def test_streaming_several_prompts_interleaves_choices(client):
    stream = client.completions.create(
        model="default", prompt=["One, two,", "Red, green,"], max_tokens=3, temperature=0, stream=True
    )
    finished = {}
    for chunk in stream:
        (choice,) = chunk.choices
        if choice.finish_reason is not None:
            finished[choice.index] = choice.finish_reason
    assert sorted(finished) == [0, 1]


def test_stop_string(client, greedy):
    text = greedy.choices[0].text
    stop = text[3:6]
    result = client.completions.create(
        model="default", prompt=PROMPT, max_tokens=10, temperature=0, stop=stop
    )
    assert result.choices[0].text == text[: text.index(stop)]
    assert result.choices[0].finish_reason == "stop"


def test_include_stop_str_in_output(client, greedy):
    text = greedy.choices[0].text
    stop = text[3:6]
    result = client.completions.create(
        model="default", prompt=PROMPT, max_tokens=10, temperature=0, stop=stop,
        extra_body={"include_stop_str_in_output": True},
    )  # fmt: skip
    assert result.choices[0].text == text[: text.index(stop) + len(stop)]


def test_stop_strings_with_logprobs(client):
    """A stop string cuts the text and the logprobs of its tokens, streamed or not, on both endpoints:
    one logprob entry per reported token, the entries' tokens adding up to the text."""
    prompt, stop = "1, 2, 3, 4,", [", 8"]
    whole = client.completions.create(
        model="default", prompt=prompt, max_tokens=20, temperature=0, stop=stop, logprobs=1
    ).choices[0]
    assert whole.finish_reason == "stop" and whole.stop_reason == ", 8"
    assert "".join(whole.logprobs.tokens) == whole.text
    assert (
        len(whole.logprobs.tokens) == len(whole.logprobs.token_logprobs) == len(whole.logprobs.top_logprobs)
    )
    chunks = client.completions.create(
        model="default", prompt=prompt, max_tokens=20, temperature=0, stop=stop, logprobs=1, stream=True
    )
    tokens = [t for c in chunks for choice in c.choices if choice.logprobs for t in choice.logprobs.tokens]
    assert tokens == whole.logprobs.tokens
    messages = [{"role": "user", "content": "Count from 1 to 10 separated by commas."}]
    ask = dict(
        model="default", messages=messages, max_tokens=30, temperature=0, stop=["5", "4,"], logprobs=True
    )
    chat = client.chat.completions.create(**ask).choices[0]
    assert "".join(e.token for e in chat.logprobs.content) == chat.message.content
    streamed = client.chat.completions.create(**ask, stream=True)
    entries = [
        e.token for c in streamed for choice in c.choices if choice.logprobs for e in choice.logprobs.content
    ]
    assert entries == [e.token for e in chat.logprobs.content]


def test_a_stop_token_or_eos_is_not_in_the_text(server, client, greedy):
    """As vLLM: the stop token (stop_token_ids) or EOS that ends a request adds no text unless
    include_stop_str_in_output, whatever skip_special_tokens says."""
    text = greedy.choices[0].text
    ids = tokenize(server, PROMPT + text)[len(tokenize(server, PROMPT)) :]
    stop_id = ids[2]
    cut = client.completions.create(
        model="default", prompt=PROMPT, max_tokens=10, temperature=0, extra_body={"stop_token_ids": [stop_id]}
    ).choices[0]
    assert cut.finish_reason == "stop" and cut.stop_reason == stop_id
    assert cut.text == server.post("/detokenize", json={"tokens": ids[:2]}).json()["prompt"]
    kept = client.completions.create(
        model="default", prompt=PROMPT, max_tokens=10, temperature=0,
        extra_body={"stop_token_ids": [stop_id], "include_stop_str_in_output": True},
    ).choices[0]  # fmt: skip
    assert kept.text == server.post("/detokenize", json={"tokens": ids[:3]}).json()["prompt"]
    answer = client.chat.completions.create(
        model="default", messages=[{"role": "user", "content": "Say hi."}], max_tokens=60, temperature=0,
        extra_body={"skip_special_tokens": False},
    ).choices[0]  # fmt: skip
    assert answer.finish_reason == "stop" and "<|im_end|>" not in answer.message.content


def test_continuous_usage_stats_count_each_choice_so_far(client):
    """vLLM's stream_options.continuous_usage_stats: beside include_usage, every chunk carries its choice's
    usage so far (the chat's role chunks none yet), and the last chunk the whole request's."""
    options = {"include_usage": True, "continuous_usage_stats": True}
    ask = dict(model="default", max_tokens=3, n=2, temperature=1, stream=True, stream_options=options)
    chunks = list(client.completions.create(prompt=PROMPT, extra_body={"ignore_eos": True}, **ask))
    *choice_chunks, last = chunks
    counts: dict[int, list[int]] = {0: [], 1: []}
    for chunk in choice_chunks:
        (choice,) = chunk.choices
        counts[choice.index].append(chunk.usage.completion_tokens)
        assert chunk.usage.total_tokens == chunk.usage.prompt_tokens + chunk.usage.completion_tokens
    for running in counts.values():
        assert running == sorted(set(running)) and running[-1] == 3  # growing, to the choice's 3 tokens
    assert last.choices == [] and last.usage.completion_tokens == 6
    messages = [{"role": "user", "content": "Hi"}]
    chat = list(client.chat.completions.create(messages=messages, extra_body={"ignore_eos": True}, **ask))
    assert [c.usage.completion_tokens for c in chat[:2]] == [0, 0]  # the role chunks
    assert [c.usage.completion_tokens for c in chat if c.choices and c.choices[0].finish_reason] == [3, 3]
    assert (
        chat[-1].usage.completion_tokens == 6 and chat[-1].usage.prompt_tokens == chat[0].usage.prompt_tokens
    )


def test_add_special_tokens_decides_a_text_prompts_bos():
    """vLLM's add_special_tokens for completions (true by default): false leaves out the BOS a tokenizer
    adds to a text prompt. The embedded SmolLM2 adds none, so a stand-in tokenizer that does."""
    from types import SimpleNamespace

    from tokenmill.entrypoints.openai.protocol import CompletionRequest
    from tokenmill.entrypoints.openai.serving_completion import CompletionServing

    class BosTokenizer:
        def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
            return [1] * add_special_tokens + [ord(c) for c in text]

    serving = CompletionServing(SimpleNamespace(engine=SimpleNamespace(tokenizer=BosTokenizer())))
    prepared = serving._prepare(CompletionRequest(prompt="ab"))
    assert prepared[0].token_ids == [1, 97, 98]
    prepared = serving._prepare(CompletionRequest(prompt="ab", add_special_tokens=False))
    assert prepared[0].token_ids == [97, 98]
