"""Turns what a caller sends, a chat conversation or a completion prompt, into the prompt text and token ids
the engine runs: the one place a chat template is applied and a prompt is tokenized."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import NamedTuple

Message = dict


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
    encode: Callable[[str], list[int]] | None = None,
    template_kwargs: dict | None = None,
) -> RenderedPrompt:
    """Render and tokenize exactly one of `prompt` (text or token ids) or `messages` (a chat conversation).

    A rendered chat template already holds the BOS token (if the model wants one), so it is tokenized
    without special tokens; a plain completion text gets them (`add_special_tokens`), as transformers does.
    Token ids pass through untouched. Bad input is a ValueError that names the knob.

    tools (OpenAI's function tools) go to a chat template that renders them; one that has no place for
    them (the embedded SmolLM2's) gets them described in a system message, with earlier calls and
    results written in the hermes form (`<tool_call>`, `<tool_response>`).

    encode: how a rendered chat becomes token ids (a ChatEncoder's, serving/chat_encoder.py, which keeps
    the pieces of earlier turns); by default the tokenizer's encode without special tokens.
    template_kwargs: more variables for the chat template (Qwen3's enable_thinking, ...)."""
    if (prompt is None) == (messages is None):
        raise ValueError("pass exactly one of prompt or messages.")
    if messages is not None:
        if tokenizer is None:
            raise ValueError("chat needs a tokenizer; drop skip_tokenizer_init=True (--skip-tokenizer-init).")
        messages = list(messages)
        uses_tools = bool(tools) or any(m.get("tool_calls") or m.get("role") == "tool" for m in messages)
        if uses_tools and not template_knows_tools(tokenizer, chat_template):
            messages, tools = messages_without_tool_support(messages, tools), None
        try:
            extra = {**(template_kwargs or {}), **({"tools": tools} if tools else {})}
            text = tokenizer.apply_chat_template(
                messages,
                tokenize=False,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                chat_template=chat_template,
                **extra,
            )
        except Exception as exc:  # a template may raise anything on a conversation it does not accept
            raise ValueError(f"the chat template rejected these messages: {exc}") from exc
        if encode is not None:
            return RenderedPrompt(text, encode(text))
        return RenderedPrompt(text, tokenizer.encode(text, add_special_tokens=False))
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ValueError(
                "prompt must be token ids when skip_tokenizer_init=True (--skip-tokenizer-init)."
            )
        return RenderedPrompt(prompt, tokenizer.encode(prompt, add_special_tokens=add_special_tokens))
    return RenderedPrompt(None, list(prompt))


# ---- tools ------------------------------------------------------------------------------------


def template_knows_tools(tokenizer, chat_template: str | None = None) -> bool:
    template = chat_template or getattr(tokenizer, "chat_template", None) or ""
    if isinstance(template, dict):
        template = " ".join(template.values())
    return "tools" in template


def tools_system_prompt(tools: list) -> str:
    """The tools described for a model whose chat template has no place for them (hermes form)."""
    listed = "\n".join(json.dumps(t["function"]) for t in tools)
    return (
        "You may call one or more functions to assist with the user query. The functions are described "
        f"within <tools></tools> XML tags:\n<tools>\n{listed}\n</tools>\n\nFor each function call, return a "
        "JSON object with the function name and arguments within <tool_call></tool_call> XML tags:\n"
        '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
    )


def messages_without_tool_support(messages: list[dict], tools: list | None) -> list[dict]:
    """Messages for a template that knows no tools: the tools in the system message, an assistant's
    calls as hermes blocks in its content, a tool's result as a `<tool_response>` from the user."""
    out = []
    for message in messages:
        message = dict(message)
        calls = message.pop("tool_calls", None)
        if calls:
            blocks = [
                "<tool_call>\n" + json.dumps({"name": c["function"]["name"], "arguments": _arguments(c)})
                + "\n</tool_call>"
                for c in calls
            ]  # fmt: skip
            message["content"] = "\n".join(filter(None, [message.get("content") or "", *blocks]))
        if message["role"] == "tool":
            message = {
                "role": "user",
                "content": f"<tool_response>\n{message.get('content') or ''}\n</tool_response>",
            }
        message.pop("tool_call_id", None)
        out.append(message)
    if tools:
        prompt = tools_system_prompt(tools)
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{prompt}"}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out


def _arguments(call: dict) -> object:
    arguments = call["function"].get("arguments", "{}")
    try:
        return json.loads(arguments) if isinstance(arguments, str) else arguments
    except json.JSONDecodeError:
        return arguments
