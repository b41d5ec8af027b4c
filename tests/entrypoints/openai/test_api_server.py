"""The server's own endpoints and its error contract: every bad input is an OpenAI-style error object with
the status code the openai client expects."""

from __future__ import annotations

import httpx
import openai
import pytest

from tokenmill import __version__

MESSAGES = [{"role": "user", "content": "Hi"}]
VLLM_METRICS = [
    "num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "prefix_cache_queries_total",
    "prefix_cache_hits_total", "num_preemptions_total", "prompt_tokens_total", "generation_tokens_total",
    "request_success_total", "time_to_first_token_seconds_bucket", "inter_token_latency_seconds_bucket",
    "e2e_request_latency_seconds_bucket", "request_queue_time_seconds_bucket",
    "request_prompt_tokens_bucket", "request_generation_tokens_bucket", "request_decode_time_seconds_bucket",
]  # fmt: skip


def assert_error(response: httpx.Response, status: int, param: str | None = None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if param is not None:
        assert error["param"] == param, error
    return error


def test_health_version_models(server):
    assert httpx.get(f"{server.url}/health").json() == {"status": "ok"}
    assert httpx.get(f"{server.url}/version").json() == {"version": __version__}
    models = httpx.get(f"{server.url}/v1/models").json()
    assert models["object"] == "list"
    assert models["data"][0]["id"] == "default" and models["data"][0]["max_model_len"] == 1024
    # vLLM's model card, field for field.
    card_fields = {"id", "object", "created", "owned_by", "root", "parent", "max_model_len", "permission"}
    assert set(models["data"][0]) == card_fields and models["data"][0]["parent"] is None
    (permission,) = models["data"][0]["permission"]
    assert permission["object"] == "model_permission" and permission["allow_sampling"] is True


def test_metrics_use_vllm_names_under_the_tokenmill_prefix(server, client):
    client.completions.create(model="default", prompt="Hi", max_tokens=2)
    response = httpx.get(f"{server.url}/metrics")
    assert response.headers["content-type"].startswith("text/plain")
    metrics = server.metrics()
    for name in VLLM_METRICS:
        assert f"tokenmill:{name}" in metrics, name
    assert metrics["tokenmill:generation_tokens_total"] >= 2
    assert metrics["tokenmill:time_to_first_token_seconds_count"] >= 1
    # Every finished request's lengths, as vLLM's dashboard draws them.
    finished = metrics["tokenmill:e2e_request_latency_seconds_count"]
    assert metrics["tokenmill:request_generation_tokens_count"] == finished
    assert metrics["tokenmill:request_generation_tokens_sum"] >= 2
    assert metrics["tokenmill:request_prompt_tokens_sum"] >= finished  # a token at least each
    # What a client's TTFT holds before the engine's clock starts: template, tokenization, checks.
    assert metrics["tokenmill:request_intake_seconds_count"] >= 1
    assert 0 < metrics["tokenmill:request_intake_seconds_sum"] < 10


def test_tokenize_and_detokenize_round_trip(server):
    tokenized = server.post("/tokenize", json={"prompt": "Hello world", "add_special_tokens": False}).json()
    assert tokenized["count"] == len(tokenized["tokens"]) and tokenized["max_model_len"] == 1024
    assert server.post("/detokenize", json={"tokens": tokenized["tokens"]}).json() == {
        "prompt": "Hello world"
    }
    chat = server.post("/tokenize", json={"messages": MESSAGES}).json()
    assert chat["count"] > tokenized["count"]  # the chat template adds the role markers
    assert_error(server.post("/detokenize", json={"tokens": [10**9]}), 400, "tokens")
    assert_error(server.post("/tokenize", json={"prompt": "a", "messages": MESSAGES}), 400)


def test_tokenize_takes_the_chat_template_knobs_and_returns_token_strs(server, client):
    """vLLM's /tokenize of chat messages: continue_final_message, tools (and chat_template, its kwargs)
    render as the chat completion renders them, so the count is its prompt_tokens; return_token_strs
    adds the tokens' strings (null otherwise)."""
    prefill = [{"role": "user", "content": "Sky?"}, {"role": "assistant", "content": "The sky is"}]
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    asks = [
        {"messages": prefill, "continue_final_message": True, "add_generation_prompt": False},
        {"messages": prefill[:1], "tools": tools, "tool_choice": "none"},
        {"messages": prefill[:1], "chat_template": "{{ messages[0]['content'] }}{{ x }}",
         "chat_template_kwargs": {"x": " Blue?"}},
    ]  # fmt: skip
    for ask in asks:
        tokenized = server.post("/tokenize", json={**ask, "return_token_strs": True}).json()
        extra = {key: value for key, value in ask.items() if key != "messages"}
        chat = client.chat.completions.create(
            model="default", messages=ask["messages"], max_tokens=1, extra_body=extra
        )
        assert tokenized["count"] == chat.usage.prompt_tokens, ask
        assert len(tokenized["token_strs"]) == tokenized["count"]
    assert server.post("/tokenize", json={"prompt": "Hi"}).json()["token_strs"] is None
    wrong = {"messages": prefill, "continue_final_message": True}  # add_generation_prompt is true
    assert_error(server.post("/tokenize", json=wrong), 400, "continue_final_message")


def test_a_growing_conversation_tokenizes_as_its_whole_rendering(server):
    """The server tokenizes chats through its ChatEncoder (earlier turns from cached pieces): every turn's
    ids equal the whole rendering tokenized, the first time and again."""
    from tokenmill.loader import resolve_model
    from tokenmill.serving.prompt import render_prompt

    tokenizer = resolve_model("default").load_tokenizer()
    messages = [{"role": "system", "content": " Answer in French.  Use digits.\n"}]
    for turn in range(4):
        messages = [*messages, {"role": "user", "content": f"Question {turn}: été ou hiver ?\t"}]
        want = render_prompt(tokenizer, messages=messages).token_ids
        for _ in range(2):
            assert server.post("/tokenize", json={"messages": messages}).json()["tokens"] == want, turn
        messages = [*messages, {"role": "assistant", "content": f" {turn}\n\n"}]


def test_reset_prefix_cache(server, client):
    def cached_tokens() -> int:
        result = client.completions.create(model="default", prompt="one two three " * 12, max_tokens=1)
        return result.usage.prompt_tokens_details.cached_tokens

    cached_tokens()
    assert cached_tokens() == 32
    assert server.post("/reset_prefix_cache").json() == {"reset": True}
    assert cached_tokens() == 0


def test_unknown_model_is_404(server, client):
    with pytest.raises(openai.NotFoundError) as caught:
        client.chat.completions.create(model="gpt-17", messages=MESSAGES, max_tokens=1)
    assert caught.value.body["code"] == "model_not_found" and caught.value.body["param"] == "model"
    assert_error(server.post("/v1/completions", json={"model": "nope", "prompt": "a"}), 404, "model")


def test_unknown_route_is_an_openai_404(server):
    assert_error(httpx.get(f"{server.url}/v1/nothing-here"), 404)


def test_malformed_json_is_400(server):
    for path in ("/v1/chat/completions", "/v1/completions"):
        error = assert_error(
            server.post(path, content=b'{"prompt": "a",', headers={"content-type": "application/json"}), 400
        )
        assert "JSON" in error["message"]
        for body, headers in ((b"[1]", {"content-type": "application/json"}), (b'{"prompt": "a"}', None)):
            # Not an object, or JSON sent without its content type: the body is named, not pydantic's.
            error = assert_error(server.post(path, content=body, headers=headers), 400)
            assert error["message"].startswith("the request body must be"), error
    # A check across fields names its field; it does not echo the whole request back as what it got.
    body = {"messages": MESSAGES, "top_logprobs": 2, "stream": False}
    error = assert_error(server.post("/v1/chat/completions", json=body), 400, "top_logprobs")
    assert error["message"] == "top_logprobs: top_logprobs needs logprobs=true"


CHAT_BAD = [
    ({"temperature": 2.5}, "temperature"),
    ({"temperature": -0.1}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"top_p": 1.01}, "top_p"),
    ({"n": 0}, "n"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_completion_tokens": -1}, "max_completion_tokens"),
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": -2.5}, "frequency_penalty"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"logit_bias": {"abc": 1}}, "logit_bias"),
    ({"logit_bias": {"5": 101}}, "logit_bias"),
    ({"logit_bias": {"99999999": 1}}, "logit_bias"),
    ({"seed": "abc"}, "seed"),
    ({"stop": [""]}, "stop"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"top_k": -2}, "top_k"),
    ({"min_p": 1.5}, "min_p"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"min_tokens": -1}, "min_tokens"),
    ({"min_tokens": 3}, "min_tokens"),  # over max_tokens
    ({"min_tokens": 4, "max_completion_tokens": 3}, "min_tokens"),
    ({"echo": True}, "echo"),  # vLLM's extras this server does not implement
    ({"cache_salt": ""}, "cache_salt"),
    ({"allowed_token_ids": [10**6]}, "allowed_token_ids"),
    ({"allowed_token_ids": []}, "allowed_token_ids"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ({"stop_token_ids": [10**6]}, "stop_token_ids"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "robot", "content": "hi"}]}, "messages.0.role"),
    ({"messages": None}, "messages"),
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
    ({"guided_regex": "a("}, "guided_regex"),
    ({"structured_outputs": {"json": {"type": "objectx"}}}, "structured_outputs"),
    ({"structured_outputs": {"jsonx": {}}}, "structured_outputs"),
    ({"guided_choice": ["a"], "guided_regex": "b"}, "guided_choice"),
    (
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
        "messages.0.content",
    ),
]


@pytest.mark.parametrize("override, param", CHAT_BAD, ids=[str(o) for o, _ in CHAT_BAD])
def test_chat_out_of_range_parameter_is_400(server, override, param):
    body = {"model": "default", "messages": MESSAGES, "max_tokens": 2, **override}
    error = assert_error(server.post("/v1/chat/completions", json=body), 400, param)
    assert error["type"] == "invalid_request_error"


COMPLETION_BAD = [
    ({"prompt": None}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": [[]]}, None),
    ({"prompt": [10**9]}, "prompt"),
    ({"prompt": [True, False]}, "prompt"),
    ({"logprobs": 21}, "logprobs"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"best_of": 2}, "best_of"),
    ({"suffix": "x"}, "suffix"),
    ({"n": 0}, "n"),
    ({"min_tokens": 3}, "min_tokens"),  # over max_tokens
    ({"use_beam_search": True}, "use_beam_search"),  # vLLM's extras this server does not implement
    ({"truncate_prompt_tokens": 4}, "truncate_prompt_tokens"),
    ({"bad_words": ["a"]}, "bad_words"),
]


@pytest.mark.parametrize("override, param", COMPLETION_BAD, ids=[str(o) for o, _ in COMPLETION_BAD])
def test_completion_out_of_range_parameter_is_400(server, override, param):
    body = {"model": "default", "prompt": "Hi", "max_tokens": 2, **override}
    assert_error(server.post("/v1/completions", json=body), 400, param)


def test_prompt_plus_max_tokens_over_the_context_is_400_with_the_numbers(server, client):
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model="default", prompt=[7] * 1000, max_tokens=100)
    message = caught.value.body["message"]
    assert "maximum context length is 1024 tokens" in message
    assert "you requested 1100 tokens (1000 in the prompt, 100 in the completion)" in message
    assert caught.value.body["code"] == "context_length_exceeded"

    error = assert_error(server.post("/v1/completions", json={"prompt": [7] * 1024}), 400, "prompt")
    assert "1024 tokens" in error["message"]
    long_messages = [{"role": "user", "content": "word " * 1100}]
    error = assert_error(
        server.post("/v1/chat/completions", json={"messages": long_messages}), 400, "messages"
    )
    assert "maximum context length is 1024 tokens" in error["message"]


def test_openai_client_raises_bad_request_for_out_of_range(client):
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="default", messages=MESSAGES, temperature=5)
    assert caught.value.status_code == 400 and caught.value.body["param"] == "temperature"


def test_server_survives_bad_input(client):
    result = client.completions.create(model="default", prompt="Hi", max_tokens=1)
    assert result.choices[0].text is not None


NULLABLE = {"n": None, "presence_penalty": None, "frequency_penalty": None, "stream": None, "top_p": None}


def test_null_for_an_optional_field_means_its_default(server):
    chat = {"model": "default", "messages": MESSAGES, "max_tokens": 2, "logprobs": None, **NULLABLE}
    response = server.post("/v1/chat/completions", json=chat)
    assert response.status_code == 200, response.text
    assert len(response.json()["choices"]) == 1  # n: null is n = 1
    # vLLM's extras this server does not implement pass when they ask for nothing.
    idle_extras = {"use_beam_search": False, "priority": 0, "bad_words": [], "prompt_logprobs": None}
    completion = {
        "model": "default",
        "prompt": "Hi",
        "max_tokens": 2,
        "echo": None,
        **NULLABLE,
        **idle_extras,
    }
    response = server.post("/v1/completions", json=completion)
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["text"] is not None
    # A required field sent as null is still missing.
    assert_error(server.post("/v1/completions", json={"prompt": None}), 400, "prompt")


def test_models_retrieve_one_by_id(server, client):
    model = client.models.retrieve("default")
    assert model.id == "default" and model.object == "model" and model.owned_by == "tokenmill"
    listed = httpx.get(f"{server.url}/v1/models").json()["data"][0]
    assert httpx.get(f"{server.url}/v1/models/default").json() == listed
    error = assert_error(httpx.get(f"{server.url}/v1/models/org/unknown-model"), 404, "model")
    assert error["code"] == "model_not_found" and "org/unknown-model" in error["message"]


def test_an_image_part_says_images_are_not_supported(server):
    content = [{"type": "text", "text": "What is this?"}, {"type": "image_url", "image_url": {"url": "x"}}]
    body = {"model": "default", "messages": [{"role": "user", "content": content}], "max_tokens": 2}
    error = assert_error(server.post("/v1/chat/completions", json=body), 400, "messages.0.content")
    assert "'image_url' are not supported" in error["message"] and "text" in error["message"]


def test_a_huge_prompt_is_tokenized_off_the_event_loop(server):
    import threading
    import time

    prompt = "lorem ipsum dolor sit amet " * 150_000  # 4 MB: seconds of tokenizing on this machine
    result = {}

    def tokenize_it():
        start = time.monotonic()
        result["response"] = server.post("/tokenize", json={"prompt": prompt})
        result["seconds"] = time.monotonic() - start

    worker = threading.Thread(target=tokenize_it)
    worker.start()
    time.sleep(0.3)  # the body is in and being tokenized
    probe_times = []
    while worker.is_alive():
        start = time.monotonic()
        assert httpx.get(f"{server.url}/health", timeout=60).status_code == 200
        probe_times.append(time.monotonic() - start)
        time.sleep(0.05)
    worker.join()
    assert result["response"].status_code == 200 and result["response"].json()["count"] > 500_000
    assert result["seconds"] > 1.0 and probe_times  # long enough for the probes to mean something
    assert max(probe_times) < 1.0, (max(probe_times), result["seconds"])
