"""A chat choice's tool answer streamed: the growing text as OpenAI's delta chunks, content and
`delta.tool_calls` (ids and names first, then argument fragments), adding up to what tool_calls.py's
parsers and calls_from_constrained make of the whole text."""

from __future__ import annotations

from .tool_calls import PARSERS, ToolCall, complete_calls, named_choice


class ToolStream:
    """A choice's growing answer text as chat deltas, for a request with tools. A named function streams
    its arguments as they are written (the first delta carries the call's id and name); `required`
    sends each call once its JSON item is complete; `auto` streams content until the parser's marker
    (held back while it may be one) and sends the calls after it when the choice finishes."""

    def __init__(self, mode: str, tool_choice: str | dict | None, parser_name: str | None, parallel: bool):
        self.mode = mode
        self.name = named_choice(tool_choice)
        self.parser = PARSERS[parser_name]() if mode == "auto" and parser_name else None
        self.parser_name = parser_name
        self.parallel = parallel
        self.sent = 0  # characters of the text already sent (content or named arguments)
        self.calls = 0
        self.tool_mode = False  # auto: the marker came; the rest is held for the parser

    def feed(self, text: str, final: bool) -> list[dict]:
        if self.mode == "named":
            return self._named(text)
        if self.mode == "required":
            return self._required(text)
        if self.parser is None:
            return self._content(text, len(text))
        return self._auto(text, final)

    def _content(self, text: str, upto: int) -> list[dict]:
        if upto <= self.sent:
            return []
        delta = text[self.sent : upto]
        self.sent = upto
        return [{"content": delta}]

    def _call(self, name: str, arguments: str) -> dict:
        call = {"index": self.calls, **ToolCall(name, arguments).to_openai(self.parser_name)}
        self.calls += 1
        return {"tool_calls": [call]}

    def _named(self, text: str) -> list[dict]:
        if not text:  # nothing of the answer yet (the model may still be thinking): no call announced
            return []
        out = []
        if self.calls == 0:
            out.append(self._call(self.name, ""))
        if len(text) > self.sent:
            out.append({"tool_calls": [{"index": 0, "function": {"arguments": text[self.sent :]}}]})
            self.sent = len(text)
        return out

    def _required(self, text: str) -> list[dict]:
        calls, self.sent = complete_calls(text, self.sent)
        return [self._call(c.name, c.arguments) for c in calls if self.parallel or not self.calls]

    def _auto(self, text: str, final: bool) -> list[dict]:
        out = []
        if not self.tool_mode:
            at = self.parser.calls_start(text, self.sent, final)
            if at is None:  # undecided: hold everything back
                return []
            if at < 0:
                return self._content(text, len(text) if final else len(text) - self.parser.held(text))
            out = self._content(text, at)
            self.tool_mode = True
        if not final:
            return out
        content, calls = self.parser.parse(text[self.sent :])
        if not calls:  # the marker led to nothing parseable: it was content after all
            return out + self._content(text, len(text))
        if content:
            out.append({"content": content})
        for call in calls if self.parallel else calls[:1]:
            out.append(self._call(call.name, call.arguments))
        return out
