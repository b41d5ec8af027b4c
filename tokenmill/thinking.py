"""A reasoning model's `<think>...</think>` tags, and what a rendered chat prompt already did with them: a
template may open the thinking for the model or close it (thinking off), which the reasoning parser and the
constraint held back until the answer (structured_outputs.AfterThinking) both follow."""

from __future__ import annotations

from tokenmill.sampling_params import PROMPT_THINKING

START, END = "<think>", "</think>"
OPEN, CLOSED = PROMPT_THINKING  # StructuredOutputsParams.prompt_thinking's values


def prompt_thinking(prompt: str | None) -> str | None:
    """What the rendered prompt says about the output's thinking. OPEN when its last `<think>` comes after
    its last `</think>` (Qwen3-Thinking-2507's, QwQ's and DeepSeek-R1's templates end the generation prompt
    with `<think>\\n`: the output starts inside the thinking, with no opening tag); CLOSED when it ends,
    whitespace aside, with `</think>` (Qwen3's with enable_thinking false ends with
    `<think>\\n\\n</think>\\n\\n`: the output is all answer); None when it says neither (no tags, or a
    thinking closed in an earlier turn, before the generation prompt: the new turn may think again): the
    parser's own rule then."""
    if not prompt:
        return None
    if prompt.rstrip().endswith(END):
        return CLOSED
    return OPEN if prompt.rfind(START) > prompt.rfind(END) else None


def starts_inside(reasoning_parser: str, thinking: str | None) -> bool:
    """Whether the output starts inside the thinking: as the prompt says (`thinking`, prompt_thinking's
    answer), else as the parser assumes (deepseek_r1's templates open `<think>`, qwen3's model writes it)."""
    return thinking == OPEN if thinking else reasoning_parser == "deepseek_r1"
