"""Reasoning output (`--reasoning-parser`): a model that thinks in `<think>...</think>` before it answers
gets the thinking in `message.reasoning_content` (`delta.reasoning_content` when streaming) and the
answer alone in `content`, as vLLM's parsers of the same names do.

The rendered chat prompt decides first (tokenmill.thinking.prompt_thinking), as vLLM reads its prompt:
- it opened `<think>` (Qwen3-Thinking-2507, QwQ, DeepSeek-R1-0528): the output starts inside the
  thinking, so everything up to `</think>` is reasoning (all of it while `</think>` has not come);
- it closed the thinking (Qwen3 with enable_thinking false): the output is all content.
A prompt that says neither (no tags, or a thinking closed in an earlier turn) leaves it to the parser:
- `deepseek_r1`: the chat template opens `<think>` in the prompt, so the output starts inside it;
- `qwen3`: the model writes `<think>` itself (or not, with thinking off); without `</think>` the whole
  output is content."""

from __future__ import annotations

from tokenmill.sampling_params import REASONING_PARSERS
from tokenmill.thinking import CLOSED, END, START, starts_inside

from .tool_calls import partial_suffix


class ReasoningParser:
    """One request's parser: `prompt_thinking` is what its rendered prompt did (OPEN, CLOSED, or None to
    follow the parser's name)."""

    def __init__(self, name: str, prompt_thinking: str | None = None) -> None:
        if name not in REASONING_PARSERS:
            raise ValueError(
                f"unknown reasoning parser {name!r}; choose one of {', '.join(REASONING_PARSERS)}"
            )
        self.answer_only = prompt_thinking == CLOSED
        self.starts_inside = starts_inside(name, prompt_thinking)

    def split(self, text: str, final: bool = True) -> tuple[str | None, str]:
        """(reasoning, content) of the text so far. Not final, a tag's first characters at the end are held
        back from both, so a stream never shows half a tag."""
        if self.answer_only:  # the prompt closed the thinking: no tag after it is the thinking's
            return None, text
        if not final:
            held = max(partial_suffix(text, END), partial_suffix(text, START))
            text = text[: len(text) - held]
            if not self.starts_inside and not text.strip():  # what may come before a <think>: held
                return None, ""
        opened = text.lstrip().startswith(START)
        # Thinking only where the prompt opened it or the output opens it: a model that answers without
        # <think> answers (its constraint applied from its first token: AfterThinking), a </think> later
        # in the answer included, so that a stream, which cannot take content back, says the same.
        if not (opened or self.starts_inside):
            return None, text
        if END in text:
            reasoning, content = text.split(END, 1)
            return reasoning.lstrip().removeprefix(START).lstrip() or None, content.lstrip()
        return text.lstrip().removeprefix(START).lstrip() or None, ""


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
