"""Turns what a caller sends, a chat conversation or a completion prompt, into the prompt text and token ids
the engine runs: the one place a chat template is applied and a prompt is tokenized."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

Message = dict[str, str]


class RenderedPrompt(NamedTuple):
    text: str | None  # None for a prompt given as token ids
    token_ids: list[int]


def render_prompt(
    tokenizer,
    prompt: str | Sequence[int] | None = None,
    *,
    messages: Sequence[Message] | None = None,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    chat_template: str | None = None,
    add_special_tokens: bool = True,
    tools: list[dict] | None = None,
) -> RenderedPrompt:
    """Render and tokenize exactly one of `prompt` (text or token ids) or `messages` (a chat conversation).

    A rendered chat template already holds the BOS token (if the model wants one), so it is tokenized
    without special tokens; a plain completion text gets them (`add_special_tokens`), as transformers does.
    Token ids pass through untouched. Bad input is a ValueError that names the knob."""
    if (prompt is None) == (messages is None):
        raise ValueError("pass exactly one of prompt or messages.")
    if messages is not None:
        if tokenizer is None:
            raise ValueError("chat needs a tokenizer; drop skip_tokenizer_init=True (--skip-tokenizer-init).")
        try:
            extra = {"tools": tools} if tools else {}
            text = tokenizer.apply_chat_template(
                list(messages),
                tokenize=False,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                chat_template=chat_template,
                **extra,
            )
        except Exception as exc:  # a template may raise anything on a conversation it does not accept
            raise ValueError(f"the chat template rejected these messages: {exc}") from exc
        return RenderedPrompt(text, tokenizer.encode(text, add_special_tokens=False))
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ValueError(
                "prompt must be token ids when skip_tokenizer_init=True (--skip-tokenizer-init)."
            )
        return RenderedPrompt(prompt, tokenizer.encode(prompt, add_special_tokens=add_special_tokens))
    return RenderedPrompt(None, list(prompt))
