"""--reasoning-parser: <think>...</think> goes to reasoning_content and the answer to content, whole and
streamed (where no delta shows half a tag); a server started with the parser routes the text."""

from __future__ import annotations

import pytest

from tests.entrypoints.openai.conftest import MAIN_SERVER_ARGS, ServerProcess
from tokenmill.entrypoints.openai.reasoning import ReasoningParser, StreamSplitter

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
    ],
)
def test_split(name, text, reasoning, content) -> None:
    assert ReasoningParser(name).split(text) == (reasoning, content)


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


def test_server_routes_the_thinking(tmp_path) -> None:
    """SmolLM2 does not think; under deepseek_r1 (the prompt opens <think>) its whole answer is thinking."""
    process = ServerProcess([*MAIN_SERVER_ARGS, "--reasoning-parser", "deepseek_r1"], tmp_path / "r.log")
    try:
        client = process.wait_ready().client()
        messages = [{"role": "user", "content": "What is 2 + 2?"}]
        response = client.chat.completions.create(
            model="default", messages=messages, max_tokens=12, temperature=0
        )
        message = response.choices[0].message
        assert message.model_extra["reasoning_content"] and not message.content
        stream = client.chat.completions.create(
            model="default", messages=messages, max_tokens=12, temperature=0, stream=True
        )
        streamed = "".join(
            (c.choices[0].delta.model_extra or {}).get("reasoning_content") or "" for c in stream if c.choices
        )
        assert streamed == message.model_extra["reasoning_content"]
    finally:
        process.stop()
