"""What a rendered chat prompt did with a reasoning model's thinking, and where the output starts: inside
the thinking or not, by the prompt first and by the parser's name when the prompt says nothing."""

from __future__ import annotations

import pytest

from tokenmill.thinking import CLOSED, OPEN, prompt_thinking, starts_inside

QWEN_TURN = "<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n<|im_start|>assistant\n"


@pytest.mark.parametrize(
    ("prompt", "thinking"),
    [
        (QWEN_TURN + "<think>\n", OPEN),  # Qwen3-Thinking-2507, QwQ-32B
        ("<｜User｜>What is 2 + 2?<｜Assistant｜><think>\n", OPEN),  # DeepSeek-R1-0528
        (QWEN_TURN + "<think>", OPEN),
        (QWEN_TURN + "<think>\nTwo and", OPEN),  # an open thinking continued (continue_final_message)
        (QWEN_TURN + "<think>\n\n</think>\n\n", CLOSED),  # Qwen3 with enable_thinking false
        (QWEN_TURN + "<think>\nTwo and two.\n</think>", CLOSED),
        (QWEN_TURN, None),  # Qwen3's own template: the model writes <think> itself
        ("<think>\nEarlier.\n</think>\n\nFour.<|im_end|>\n" + QWEN_TURN, None),  # an earlier turn's
        (QWEN_TURN + "<think>\n\n</think>\n\nFour.<|im_end|>\n" + QWEN_TURN + "<think>\n", OPEN),
        ("What is 2 + 2?", None),
        ("", None),
        (None, None),  # a prompt given as token ids
    ],
)
def test_prompt_thinking(prompt, thinking) -> None:
    assert prompt_thinking(prompt) == thinking


def test_tags_the_callers_messages_mention_open_nothing() -> None:
    """A system or user message that mentions `<think>` is the caller's text, not the template's: with the
    conversation given, only what the template wrote after it (and an assistant message it continues)
    says whether the thinking is open."""
    system = "Answer in JSON. You may reason inside <think> tags first."
    user = [{"type": "text", "text": "Open with <think>"}]
    messages = [{"role": "system", "content": system}, {"role": "user", "content": user}]
    rendered = f"<|im_start|>system\n{system}<|im_end|>\n<|im_start|>user\nOpen with <think><|im_end|>\n"
    prompt = rendered + "<|im_start|>assistant\n"
    assert prompt_thinking(prompt) == OPEN  # (read over the whole prompt)
    assert prompt_thinking(prompt, messages) is None
    assert prompt_thinking(prompt + "<think>\n", messages) == OPEN
    continued = [*messages, {"role": "assistant", "content": "<think>\nFirst,"}]
    assert prompt_thinking(prompt + "<think>\nFirst,", continued) == OPEN


@pytest.mark.parametrize(
    ("parser", "thinking", "inside"),
    [
        ("qwen3", OPEN, True),
        ("qwen3", CLOSED, False),
        ("qwen3", None, False),
        ("deepseek_r1", OPEN, True),
        ("deepseek_r1", CLOSED, False),
        ("deepseek_r1", None, True),
    ],
)
def test_the_prompt_decides_before_the_parser(parser, thinking, inside) -> None:
    assert starts_inside(parser, thinking) is inside
