"""--reasoning-parser: <think>...</think> goes to reasoning_content and the answer to content, whole and
streamed (where no delta shows half a tag); a server started with the parser routes the text."""

from __future__ import annotations

import pytest

from tests.entrypoints.openai.conftest import ServerProcess
from tokenmill.entrypoints.openai.protocol import ChatCompletionRequest
from tokenmill.entrypoints.openai.reasoning import ReasoningParser, StreamSplitter
from tokenmill.entrypoints.openai.serving_chat import ToolAnswer
from tokenmill.thinking import CLOSED, OPEN, check_reasoning_tokens

THOUGHT = "<think>\nTwo and two.\n</think>\n\nIt is 4."


@pytest.mark.parametrize(
    ("name", "text", "reasoning", "content"),
    [
        ("deepseek_r1", THOUGHT, "Two and two.\n", "It is 4."),
        ("deepseek_r1", "Two and two.</think>Four.", "Two and two.", "Four."),
        ("deepseek_r1", "Still thinking", "Still thinking", ""),
        ("qwen3", THOUGHT, "Two and two.\n", "It is 4."),
        ("qwen3", "Four.", None, "Four."),
        ("qwen3", "<think>unfinished", "unfinished", ""),
        # Under qwen3 the model opens the thinking first or not at all: a later </think> is the answer's.
        ("qwen3", "Plan it.</think>\n\nAnswer.", None, "Plan it.</think>\n\nAnswer."),
        ("qwen3", "\n <think>Plan.</think>Ok.", "Plan.", "Ok."),
        ("deepseek_r1", "\n <think>Plan.</think>Ok.", "Plan.", "Ok."),
    ],
)
def test_split(name, text, reasoning, content) -> None:
    assert ReasoningParser(name).split(text) == (reasoning, content)


@pytest.mark.parametrize("name", ["deepseek_r1", "qwen3"])
@pytest.mark.parametrize(
    "text", ["Plan it.</think>\n\nAnswer.", "\n <think>Plan.</think>Ok.", THOUGHT, "  Four.", "\n\n"]
)
def test_a_stream_says_what_the_whole_message_says(name, text) -> None:
    """Streamed a character at a time, the deltas add up to the split of the whole text (a stream cannot
    take back content it sent: what may turn out to be thinking is never sent as content)."""
    splitter, deltas = StreamSplitter(ReasoningParser(name)), []
    for end in range(1, len(text) + 1):
        deltas.append(splitter.delta(text[:end], final=False))
    deltas.append(splitter.delta(text, final=True))
    reasoning, content = ReasoningParser(name).split(text)
    assert "".join(d.get("reasoning_content", "") for d in deltas) == (reasoning or "")
    assert "".join(d.get("content", "") for d in deltas) == content


@pytest.mark.parametrize(
    ("name", "thinking", "text", "reasoning", "content"),
    [
        # The template opened <think> (Qwen3-Thinking-2507, QwQ): the output starts inside it, qwen3 or not.
        ("qwen3", OPEN, "Two and two.\n</think>\n\nIt is 4.", "Two and two.\n", "It is 4."),
        ("qwen3", OPEN, "Still thinking", "Still thinking", ""),
        ("qwen3", OPEN, THOUGHT, "Two and two.\n", "It is 4."),
        # The template closed it (enable_thinking false): all answer, under deepseek_r1 too.
        ("deepseek_r1", CLOSED, "It is 4.", None, "It is 4."),
        ("qwen3", CLOSED, "It is 4.", None, "It is 4."),
        ("deepseek_r1", CLOSED, "", None, ""),
    ],
)
def test_the_prompt_decides_the_split(name, thinking, text, reasoning, content) -> None:
    assert ReasoningParser(name, thinking).split(text) == (reasoning, content)


@pytest.mark.parametrize("name", ["deepseek_r1", "qwen3"])
def test_stream_deltas_add_up_and_never_show_half_a_tag(name) -> None:
    splitter, text, deltas = StreamSplitter(ReasoningParser(name)), "", []
    for character in THOUGHT:
        text += character
        deltas.append(splitter.delta(text, final=False))
    deltas.append(splitter.delta(text, final=True))
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "Two and two.\n"
    assert "".join(d.get("content", "") for d in deltas) == "It is 4."
    assert not any("<" in d.get("content", "") + d.get("reasoning_content", "") for d in deltas)


def test_a_stream_from_inside_an_opened_thinking_shows_no_content_before_the_answer() -> None:
    """Under qwen3 with a template that opened <think>: reasoning deltas until </think>, then content."""
    splitter, text, deltas = StreamSplitter(ReasoningParser("qwen3", OPEN)), "", []
    for character in "Two and two.\n</think>\n\nIt is 4.":
        text += character
        deltas.append(splitter.delta(text, final=False))
    deltas.append(splitter.delta(text, final=True))
    kinds = [kind for d in deltas for kind in d]
    assert kinds == ["reasoning_content"] * kinds.count("reasoning_content") + ["content"] * kinds.count(
        "content"
    )
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "Two and two.\n"
    assert "".join(d.get("content", "") for d in deltas) == "It is 4."


def thinking_model(path) -> str:
    """A small random Llama whose tokenizer (SmolLM2's) has `<think>` and `</think>` as tokens of their
    own (ids 49152 and 49153), as Qwen3's and DeepSeek-R1's have."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from tokenmill.loader import resolve_model

    tokenizer = resolve_model("default").load_tokenizer()
    tokenizer.add_tokens(["<think>", "</think>"])
    assert tokenizer.convert_tokens_to_ids(["<think>", "</think>"]) == [49152, 49153]
    tokenizer.save_pretrained(path)
    config = LlamaConfig(
        vocab_size=49154, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=1024, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, tie_word_embeddings=True,
    )  # fmt: skip
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def thinking_model_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    return thinking_model(tmp_path_factory.mktemp("thinking") / "model")


@pytest.fixture(scope="module")
def reasoning_servers(thinking_model_path: str, tmp_path_factory: pytest.TempPathFactory):
    """{parser: a server on the thinking model with that --reasoning-parser}, both started at once (they
    boot side by side on the two cores) and each waited for in the test that uses it."""
    args = ["--model", thinking_model_path, "--dtype", "float32", "--max-model-len", "1024"]
    args += ["--num-kv-blocks", "128"]
    logs = tmp_path_factory.mktemp("reasoning")
    processes = {}
    try:
        for parser in ("deepseek_r1", "qwen3"):
            processes[parser] = ServerProcess([*args, "--reasoning-parser", parser], logs / f"{parser}.log")
        yield processes
    finally:
        for process in processes.values():
            process.stop()


def test_constraints_apply_to_the_answer_after_the_thinking(thinking_model_path, reasoning_servers) -> None:
    """Under a reasoning parser a constraint leaves the thinking free and constrains the answer after
    `</think>` (as vLLM's do): the answer is the schema's, in content, not in reasoning_content. The
    random model ends its thinking at once here (a logit bias on `</think>`, which the grammar then
    forbids); without it, it never does, and all of its answer is thinking."""
    import json

    import jsonschema

    model, process = thinking_model_path, reasoning_servers["deepseek_r1"]
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    think_once = {"49153": 100}
    client = process.wait_ready().client()
    ask = dict(model=model, messages=[{"role": "user", "content": "Ok?"}], max_tokens=24, temperature=0)
    answer = client.chat.completions.create(
        **ask, logit_bias=think_once,
        response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": schema}},
    ).choices[0]  # fmt: skip
    jsonschema.validate(json.loads(answer.message.content), schema)
    assert answer.finish_reason == "stop" and not answer.message.model_extra.get("reasoning_content")
    stream = client.chat.completions.create(
        **ask, logit_bias=think_once, stream=True, extra_body={"guided_choice": ["yes", "no"]}
    )
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) in ("yes", "no")
    tool = {"type": "function", "function": {"name": "f", "parameters": schema}}
    called = client.chat.completions.create(
        **ask,
        logit_bias=think_once,
        tools=[tool],
        tool_choice={"type": "function", "function": {"name": "f"}},
    ).choices[0]
    (call,) = called.message.tool_calls
    jsonschema.validate(json.loads(call.function.arguments), schema)
    free = client.chat.completions.create(**{**ask, "max_tokens": 8}, extra_body={"guided_choice": ["yes"]})
    assert free.choices[0].finish_reason == "length" and not free.choices[0].message.content
    assert free.choices[0].message.model_extra["reasoning_content"]
    # Unconstrained and never closing its thinking (SmolLM2's template opens none: deepseek_r1's rule),
    # the whole answer is thinking, streamed or not.
    message = client.chat.completions.create(**{**ask, "max_tokens": 8}).choices[0].message
    assert message.model_extra["reasoning_content"] and not message.content
    stream = client.chat.completions.create(**{**ask, "max_tokens": 8}, stream=True)
    streamed = "".join(
        (c.choices[0].delta.model_extra or {}).get("reasoning_content") or "" for c in stream if c.choices
    )
    assert streamed == message.model_extra["reasoning_content"]


# Qwen3-Thinking-2507's way (the generation prompt opens <think>), or Qwen3's with enable_thinking false
# (an empty thinking, closed).
THINKING_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n"
    "{% else %}<think>\n{% endif %}{% endif %}"
)


def test_the_chat_template_decides_where_the_thinking_is(thinking_model_path, reasoning_servers) -> None:
    """Under qwen3, a template that opens <think> in the prompt makes the whole output thinking (the
    random model never closes it), streamed or not, and leaves it free of the constraint, which waits
    for `</think>`; one that closes it (enable_thinking false) makes it all answer, constrained from the
    first token even where the model would open a thinking of its own (a logit bias on `<think>`)."""
    model, process = thinking_model_path, reasoning_servers["qwen3"]
    opened = {"chat_template": THINKING_TEMPLATE}
    closed = {**opened, "chat_template_kwargs": {"enable_thinking": False}}
    think_first = {"49152": 100}
    client = process.wait_ready().client()
    ask = dict(model=model, messages=[{"role": "user", "content": "Ok?"}], max_tokens=8, temperature=0)
    thought = client.chat.completions.create(**ask, extra_body=opened).choices[0].message
    assert thought.model_extra["reasoning_content"] and thought.content is None
    stream = list(client.chat.completions.create(**ask, extra_body=opened, stream=True))
    deltas = [c.choices[0].delta for c in stream if c.choices]
    assert (
        "".join((d.model_extra or {}).get("reasoning_content") or "" for d in deltas)
        == (thought.model_extra["reasoning_content"])
    )
    assert not "".join(d.content or "" for d in deltas)
    free = client.chat.completions.create(**ask, extra_body={**opened, "guided_choice": ["yes"]})
    assert free.choices[0].finish_reason == "length" and free.choices[0].message.content is None
    assert (
        free.choices[0].message.model_extra["reasoning_content"] == thought.model_extra["reasoning_content"]
    )

    answer = client.chat.completions.create(**ask, logit_bias=think_first, extra_body=closed).choices[0]
    assert answer.message.content == "<think>" * 8 and answer.message.model_extra["reasoning_content"] is None
    stream = client.chat.completions.create(**ask, logit_bias=think_first, extra_body=closed, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == "<think>" * 8
    constrained = client.chat.completions.create(
        **ask, logit_bias=think_first, extra_body={**closed, "guided_choice": ["yes"]}
    ).choices[0]
    assert (constrained.finish_reason, constrained.message.content) == ("stop", "yes")


TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
CALL = '<tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>'


@pytest.mark.parametrize(
    ("name", "thinking", "text", "reasoning", "content", "calls"),
    [
        ("deepseek_r1", None, "Hmm, thinking", "Hmm, thinking", None, []),  # cut inside the thinking
        ("qwen3", None, "<think>Plan.</think>", "Plan.", None, []),
        ("qwen3", None, f"<think>Plan.</think>\n\n{CALL}", "Plan.", None, ['{"a": 1}']),
        ("deepseek_r1", None, f"Plan.\n</think>\n\nOk.\n{CALL}", "Plan.\n", "Ok.\n", ['{"a": 1}']),
        # What the prompt did with the thinking decides (tokenmill.thinking.prompt_thinking).
        ("qwen3", OPEN, f"Plan.\n</think>\n\n{CALL}", "Plan.\n", None, ['{"a": 1}']),
        ("qwen3", OPEN, f"Plan, {CALL}", f"Plan, {CALL}", None, []),  # a call inside the thinking: none
        ("deepseek_r1", CLOSED, f"Ok.\n{CALL}", None, "Ok.\n", ['{"a": 1}']),
    ],
)
def test_a_message_of_thinking_and_calls_streamed_or_not(
    name, thinking, text, reasoning, content, calls
) -> None:
    """No answer after the thinking is a null content (vLLM's), not ""; a stream's deltas add up to it."""
    request = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}], tools=TOOLS)
    answer = ToolAnswer(request, "hermes", name, thinking=thinking)
    message = answer.message(text, "stop")["message"]
    assert (message["reasoning_content"], message["content"]) == (reasoning, content)
    assert [c["function"]["arguments"] for c in message.get("tool_calls", [])] == calls
    splitter, stream, deltas = StreamSplitter(answer.reasoning), answer.stream(), []
    for end in [*range(1, len(text), 3), len(text)]:
        final = end == len(text)
        # As serving_chat streams: the thinking from the splitter, the answer through the tool stream.
        deltas.append({"reasoning_content": splitter.delta(text[:end], final).get("reasoning_content", "")})
        deltas += stream.feed(splitter.content, final)
    assert "".join(d.get("reasoning_content", "") for d in deltas) == (reasoning or "")
    assert "".join(d.get("content", "") for d in deltas) == (content or "")
    assert [c["function"]["arguments"] for d in deltas for c in d.get("tool_calls", [])] == calls


@pytest.mark.parametrize("text", ["<think>Plan, still", '<think>Plan.</think>{"a": 1}'])
def test_a_named_call_streams_nothing_while_the_model_thinks(text) -> None:
    """tool_choice naming a function under qwen3: the call's header goes out with the answer's first
    text, not before the thinking (a message cut inside the thinking has no call)."""
    request = ChatCompletionRequest(
        model="m", messages=[{"role": "user", "content": "hi"}], tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "f"}},
    )  # fmt: skip
    answer = ToolAnswer(request, None, "qwen3")
    message = answer.message(text, "stop")["message"]
    splitter, stream, deltas = StreamSplitter(answer.reasoning), answer.stream(), []
    for end in range(1, len(text) + 1):
        final = end == len(text)
        thought = splitter.delta(text[:end], final).get("reasoning_content", "")
        deltas += [{"reasoning_content": thought}] if thought else []
        deltas += stream.feed(splitter.content, final)
    calls = [c for d in deltas for c in d.get("tool_calls", [])]
    whole = message.get("tool_calls") or []
    assert [c["function"]["name"] for c in calls if "name" in c["function"]] == [
        c["function"]["name"] for c in whole
    ]
    assert "".join(c["function"]["arguments"] for c in calls) == "".join(
        c["function"]["arguments"] for c in whole
    )
    if calls:  # the thinking first, then the call
        assert "reasoning_content" in deltas[0] and "tool_calls" in deltas[-1]


def test_a_parser_is_refused_for_a_tokenizer_without_the_tags() -> None:
    """SmolLM2's tokenizer has no `<think>` token: its answers would all be filed as reasoning."""
    from tokenmill.loader import resolve_model

    tokenizer = resolve_model("default").load_tokenizer()
    check_reasoning_tokens(None, tokenizer)
    with pytest.raises(ValueError, match=r"--reasoning-parser deepseek_r1: .* no <think> or </think> token"):
        check_reasoning_tokens("deepseek_r1", tokenizer)
    with pytest.raises(ValueError, match="drop skip_tokenizer_init"):
        check_reasoning_tokens("qwen3", None)
    tokenizer.add_tokens(["<think>", "</think>"])
    check_reasoning_tokens("qwen3", tokenizer)
