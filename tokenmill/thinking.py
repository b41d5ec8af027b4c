"""A reasoning model's `<think>...</think>` tags, and what a rendered chat prompt already did with them: a
template may open the thinking for the model or close it (thinking off), which the reasoning parser and the
constraint held back until the answer (AfterThinking, below) both follow."""

from __future__ import annotations

import numpy as np

from tokenmill.sampling_params import PROMPT_THINKING

START, END = "<think>", "</think>"
OPEN, CLOSED = PROMPT_THINKING  # StructuredOutputsParams.prompt_thinking's values


def prompt_thinking(prompt: str | None, messages=None) -> str | None:
    """What the rendered prompt says about the output's thinking. OPEN when its last `<think>` comes after
    its last `</think>` (Qwen3-Thinking-2507's, QwQ's and DeepSeek-R1's templates end the generation prompt
    with `<think>\\n`: the output starts inside the thinking, with no opening tag); CLOSED when it ends,
    whitespace aside, with `</think>` (Qwen3's with enable_thinking false ends with
    `<think>\\n\\n</think>\\n\\n`: the output is all answer); None when it says neither (no tags, or a
    thinking closed in an earlier turn, before the generation prompt: the new turn may think again): the
    parser's own rule then. messages: the conversation it was rendered from; OPEN is then read only after
    its last message that is not the model's (a system or user message that mentions `<think>` opens
    nothing; an assistant message left open for the model to continue may)."""
    if not prompt:
        return None
    if prompt.rstrip().endswith(END):
        return CLOSED
    tail = prompt[_after_the_callers_text(prompt, messages) :]
    return OPEN if tail.rfind(START) > tail.rfind(END) else None


def _after_the_callers_text(prompt: str, messages) -> int:
    """Where the rendered prompt's text after the last non-assistant message's content begins (0 where it
    is not found as written, e.g. a template that rewrites it)."""
    for message in reversed(list(messages or ())):
        if message.get("role") == "assistant":
            continue
        content = message.get("content")
        if isinstance(content, list):  # text parts: the last one
            texts = [p.get("text") for p in content if isinstance(p, dict) and p.get("type") == "text"]
            content = texts[-1] if texts else None
        text = content.strip() if isinstance(content, str) else ""
        at = prompt.rfind(text) if text else -1
        return at + len(text) if at >= 0 else 0
    return 0


def starts_inside(reasoning_parser: str, thinking: str | None) -> bool:
    """Whether the output starts inside the thinking: as the prompt says (`thinking`, prompt_thinking's
    answer), else as the parser assumes (deepseek_r1's templates open `<think>`, qwen3's model writes it)."""
    return thinking == OPEN if thinking else reasoning_parser == "deepseek_r1"


def check_reasoning_tokens(name: str | None, tokenizer, knob: str = "--reasoning-parser") -> None:
    """A ValueError at start-up where the reasoning parser (`knob`: the server's flag, or LLM's
    reasoning_parser) names a parser the model's tokenizer cannot serve: without `<think>` and `</think>`
    as tokens of their own the model does not think in them, and the parser would file its answers (a
    constrained one too) under reasoning (vLLM refuses the same)."""
    if not name:
        return
    if tokenizer is None:
        raise ValueError(f"{knob} {name} reads the output's text: drop skip_tokenizer_init")
    vocab = tokenizer.get_vocab()
    missing = [tag for tag in (START, END) if tag not in vocab]
    if missing:
        raise ValueError(
            f"{knob} {name}: the model's tokenizer has no {' or '.join(missing)} token, so the model does "
            f"not write its thinking in those tags; drop {knob} for this model"
        )


class AfterThinking:
    """A request's grammar held back while its model thinks (StructuredOutputsParams.reasoning): the
    thinking's tokens go free and are not the grammar's; the answer after `</think>` is. Where the chat
    template opened the thinking (prompt_thinking "open"), and under deepseek_r1 where the prompt says
    nothing, the output starts inside it; under qwen3 the model opens it with its first token or not at
    all (that token's mask: the grammar's, and `<think>`). A prompt that closed the thinking gets no gate
    (StructuredOutputs.matcher). Takes a matcher's place for the engine (consume_token, is_stopped, is_error);
    bitmask_fill fills its row."""

    __slots__ = ("matcher", "start", "end", "thinking", "first")

    def __init__(self, matcher, start: int, end: int, inside: bool) -> None:
        self.matcher, self.start, self.end = matcher, start, end
        self.thinking = inside
        self.first = not inside  # the first token may open the thinking

    def consume_token(self, token: int) -> bool:
        if self.first:
            self.first = False
            if token == self.start:
                self.thinking = True
                return True
        if self.thinking:
            self.thinking = token != self.end
            return True
        return self.matcher.consume_token(token)

    def is_stopped(self) -> bool:
        return not self.thinking and self.matcher.is_stopped()

    def is_error(self) -> bool:
        return not self.thinking and self.matcher.is_error()

    def get_error(self) -> str:
        return self.matcher.get_error()


def finish_gated(gated: list[tuple[AfterThinking, int]], mask: np.ndarray) -> None:
    """AfterThinking rows: everything while the model thinks; `<think>` allowed beside the grammar's
    tokens where the first token may open the thinking."""
    words = mask.view(np.uint32)
    for gate, row in gated:
        if gate.thinking:
            mask[row] = -1
        elif gate.first:
            words[row, gate.start >> 5] |= np.uint32(1 << (gate.start & 31))
