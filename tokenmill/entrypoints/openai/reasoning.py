"""Reasoning output (`--reasoning-parser`): a model that thinks in `<think>...</think>` before it answers
gets the thinking in `message.reasoning_content` (`delta.reasoning_content` when streaming) and the
answer alone in `content`, as vLLM's parsers of the same names do.

- `deepseek_r1`: the chat template opens `<think>` in the prompt, so the output starts inside it;
  everything up to `</think>` is reasoning (all of it while `</think>` has not come).
- `qwen3`: the model writes `<think>` itself (or not, with thinking off); without `</think>` the whole
  output is content."""

from __future__ import annotations

from tokenmill.sampling_params import REASONING_PARSERS

from .tool_calls import partial_suffix

START, END = "<think>", "</think>"


class ReasoningParser:
    def __init__(self, name: str) -> None:
        if name not in REASONING_PARSERS:
            raise ValueError(
                f"unknown reasoning parser {name!r}; choose one of {', '.join(REASONING_PARSERS)}"
            )
        self.starts_inside = name == "deepseek_r1"

    def split(self, text: str, final: bool = True) -> tuple[str | None, str]:
        """(reasoning, content) of the text so far. Not final, a tag's first characters at the end are held
        back from both, so a stream never shows half a tag."""
        if not final:
            held = max(partial_suffix(text, END), partial_suffix(text, START))
            text = text[: len(text) - held]
        if END in text:
            reasoning, content = text.split(END, 1)
            return reasoning.lstrip().removeprefix(START).lstrip() or None, content.lstrip()
        if text.lstrip().startswith(START):  # thinking, not closed (yet)
            return text.lstrip().removeprefix(START).lstrip() or None, ""
        if self.starts_inside:  # the prompt opened <think>: all of it is thinking until </think>
            return text.lstrip() or None, ""
        return None, text


class StreamSplitter:
    """Per choice: the reasoning and content deltas a stream's growing text adds."""

    def __init__(self, parser: ReasoningParser) -> None:
        self.parser = parser
        self.sent = ("", "")

    def delta(self, text: str, final: bool) -> dict:
        reasoning, content = self.parser.split(text, final)
        reasoning = reasoning or ""
        sent_reasoning, sent_content = self.sent
        out = {}
        if len(reasoning) > len(sent_reasoning) and reasoning.startswith(sent_reasoning):
            out["reasoning_content"] = reasoning[len(sent_reasoning) :]
        if len(content) > len(sent_content) and content.startswith(sent_content):
            out["content"] = content[len(sent_content) :]
        self.sent = (reasoning, content)
        return out

    @property
    def content(self) -> str:
        """The answer so far, as of the last delta (a stream's tool parsing reads it)."""
        return self.sent[1]
