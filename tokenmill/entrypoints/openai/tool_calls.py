"""Tool calling on chat completions: how tools reach the prompt, how tool_choice constrains the output,
and the parsers that find tool calls in what a model wrote (tool_stream.py streams them).

- `required` and a named function are enforced with a grammar (structured outputs), so the arguments
  always parse against the tool's schema, whatever the model: a named function's output is its
  arguments object; `required` writes a JSON list of {"name", "parameters"} items, one per call.
- `auto` lets the model write freely and a parser (`--tool-call-parser`) finds the calls in its text:
  `hermes` (`<tool_call>{"name": ..., "arguments": ...}</tool_call>`, Qwen2.5/Qwen3, Hermes, SmolLM2),
  `llama3_json` (a JSON object `{"name": ..., "parameters": ...}`, after `<|python_tag|>` or alone) and
  `mistral` (`[TOOL_CALLS] [{"name": ..., "arguments": ...}]`).
- How tools reach the prompt is serving/prompt.py's (render_prompt's `tools`)."""

from __future__ import annotations

import json
import random
import re
import string
import uuid
from typing import NamedTuple

from tokenmill.sampling_params import StructuredOutputsParams

from .errors import ParamError


class ToolCall(NamedTuple):
    name: str
    arguments: str  # a JSON object's text

    def to_openai(self, parser_name: str | None = None) -> dict:
        return {
            "id": new_call_id(parser_name),
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


def new_call_id(parser_name: str | None) -> str:
    """A call's id. Mistral's chat templates (and mistral_common) refuse a conversation whose tool call ids
    are not 9 alphanumerics, so a client that sends the calls back needs them in that shape, as vLLM's
    mistral parser makes them."""
    if parser_name == "mistral":
        return "".join(random.choices(string.ascii_letters + string.digits, k=9))
    return f"call_{uuid.uuid4().hex[:24]}"


def check_tools(tools: list | None, tool_choice: str | dict | None) -> None:
    """The request's tools and tool_choice are well formed and agree; ParamError naming the field."""
    names: set[str] = set()
    for index, tool in enumerate(tools or []):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(function, dict):
            raise ParamError(f"tools.{index}", "each tool must be {'type': 'function', 'function': {...}}")
        if not isinstance(function.get("name"), str) or not function["name"]:
            raise ParamError(f"tools.{index}.function.name", "a tool's function needs a name")
        if function["name"] in names:
            raise ParamError(f"tools.{index}.function.name", f"two tools are named {function['name']!r}")
        names.add(function["name"])
        parameters = function.get("parameters")  # absent or null (as vLLM takes it): no arguments
        if parameters is not None and not isinstance(parameters, dict):
            raise ParamError(
                f"tools.{index}.function.parameters", "a function's parameters are a JSON schema"
            )
    if tool_choice is None or tool_choice == "none":
        return
    if not tools:  # as OpenAI and vLLM answer it
        raise ParamError("tool_choice", f"tool_choice {tool_choice!r} is only allowed when tools are given")
    if tool_choice in ("auto", "required"):
        return
    name = named_choice(tool_choice)
    if name is None:
        raise ParamError(
            "tool_choice", "tool_choice must be 'none', 'auto', 'required' or {'type': 'function', ...}"
        )
    if name not in [t["function"]["name"] for t in tools or []]:
        raise ParamError("tool_choice", f"tool_choice names the function {name!r}, which is not in tools")


def named_choice(tool_choice: str | dict | None) -> str | None:
    if isinstance(tool_choice, dict) and tool_choice.get("type") == "function":
        function = tool_choice.get("function")
        if isinstance(function, dict) and isinstance(function.get("name"), str):
            return function["name"]
    return None


def _parameters(tool: dict) -> dict:
    return tool["function"].get("parameters") or {"type": "object", "properties": {}}


def tool_constraint(
    tools: list, tool_choice: str | dict | None, parallel: bool = True
) -> StructuredOutputsParams | None:
    """The grammar that enforces `required` (one call, or several when parallel) or a named function
    (None for none and auto)."""
    name = named_choice(tool_choice)
    if name is not None:
        tool = next(t for t in tools if t["function"]["name"] == name)
        return StructuredOutputsParams(json=json.dumps(_parameters(tool)))  # as text: see constraints.as_text
    if tool_choice != "required":
        return None
    # Each tool's parameters as a definition of the list's schema, its own references ("#/$defs/...",
    # as pydantic writes nested models) moved under it: embedded as they are, they would point at the
    # list's root.
    definitions = {
        f"tool_{i}": _moved_under(_parameters(t), f"#/$defs/tool_{i}") for i, t in enumerate(tools)
    }
    calls = [
        {
            "type": "object",
            "properties": {
                "name": {"const": t["function"]["name"]},
                "parameters": {"$ref": f"#/$defs/tool_{i}"},
            },
            "required": ["name", "parameters"],
            "additionalProperties": False,
        }
        for i, t in enumerate(tools)
    ]
    calls_list = {"type": "array", "minItems": 1, "items": {"anyOf": calls}, "$defs": definitions}
    if not parallel:
        calls_list["maxItems"] = 1
    return StructuredOutputsParams(json=json.dumps(calls_list))


def _moved_under(schema: object, pointer: str) -> object:
    """schema with its local references ("#", "#/...") pointing into where it now sits, at `pointer`."""
    if isinstance(schema, list):
        return [_moved_under(item, pointer) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {key: _moved_under(value, pointer) for key, value in schema.items()}
    ref = schema.get("$ref")
    if isinstance(ref, str) and (ref == "#" or ref.startswith("#/")):
        out["$ref"] = pointer + ref[1:]
    return out


def calls_from_constrained(text: str, tool_choice: str | dict) -> list[ToolCall]:
    """What a grammar-enforced output means: the named function's arguments, or the calls of
    `required`'s list that are complete (all of them, unless max_tokens cut the list: then those before
    the cut, as a stream sends them)."""
    name = named_choice(tool_choice)
    if name is not None:
        return [ToolCall(name, text)] if text.strip() else []  # nothing written: cut before the call
    return complete_calls(text, 0)[0]


def complete_calls(text: str, position: int) -> tuple[list[ToolCall], int]:
    """The calls of `required`'s list ([{"name": ..., "parameters": {...}}, ...]) complete in text from
    position on, and where the last of them ends (position if none)."""
    if "[" not in text:
        return [], position
    position = max(position, text.find("[") + 1)
    decoder = json.JSONDecoder()
    calls = []
    while True:
        start = position
        while start < len(text) and text[start] in " \n\t\r,":
            start += 1
        try:
            item, end = decoder.raw_decode(text, start)
        except json.JSONDecodeError:
            return calls, position  # not complete yet (or the list's end)
        if isinstance(item, dict) and isinstance(item.get("name"), str):
            calls.append(ToolCall(item["name"], json.dumps(item.get("parameters", {}), ensure_ascii=False)))
        position = end


# ---- parsers for tool_choice auto ------------------------------------------------------------


def partial_suffix(text: str, marker: str) -> int:
    """How many characters at the end of `text` could be the start of `marker` (held back from a stream
    until the next characters tell)."""
    return next((n for n in range(len(marker) - 1, 0, -1) if text.endswith(marker[:n])), 0)


class _MarkerParser:
    """A parser whose calls begin at a marker, with content before it."""

    marker = ""

    def calls_start(self, text: str, sent: int, final: bool) -> int | None:
        """Where the calls begin in the text so far (-1: not yet), None while that cannot be told."""
        return text.find(self.marker, sent)

    def held(self, text: str) -> int:
        return partial_suffix(text, self.marker)


def _call_from_object(item: object, arguments_key: str) -> ToolCall | None:
    """A call from a parsed JSON item, None unless it names a function and gives its arguments (a JSON
    answer with a "name" key is no call: vLLM's parsers take it as content too)."""
    if not isinstance(item, dict) or not isinstance(item.get("name"), str):
        return None
    key = next((k for k in (arguments_key, "arguments", "parameters") if k in item), None)
    if key is None:
        return None
    arguments = item[key]
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return None
    if not isinstance(arguments, dict):
        return None
    return ToolCall(item["name"], json.dumps(arguments, ensure_ascii=False))


class HermesParser(_MarkerParser):
    """`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, any number, text around them kept."""

    marker = "<tool_call>"
    marker_is_special = True  # in some Hermes models' tokenizers
    _block = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """The calls, or none and the whole text as content where any block is no call (as vLLM's parser:
        a malformed or cut block is not dropped while the others pass)."""
        calls = []
        for body in self._block.findall(text):
            try:
                call = _call_from_object(json.loads(body), "arguments")
            except json.JSONDecodeError:
                call = None
            if call is None:
                return text, []
            calls.append(call)
        if not calls:
            return text, []
        # The text before the calls as written (as a stream sends it, and as vLLM returns it).
        return text[: text.index(self.marker)] or None, calls


class Llama3JsonParser:
    """Llama 3.x's JSON tool calls: `{"name": ..., "parameters": {...}}` (after `<|python_tag|>` or as the
    whole message), several separated by `;`."""

    def calls_start(self, text: str, sent: int, final: bool) -> int | None:
        """A call is the whole message: its first characters decide, once and for all."""
        if sent:
            return -1
        head = text.lstrip()
        if head.startswith(("{", "<|python_tag|>")):
            return 0
        if not final and (not head or "<|python_tag|>".startswith(head)):
            return None
        return -1

    def held(self, text: str) -> int:
        return 0

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        # As calls_start decides for a stream: a call is the whole message, text before it makes it content.
        body = text.lstrip().removeprefix("<|python_tag|>").strip()
        if not body.startswith("{"):
            return text, []
        calls = []
        decoder = json.JSONDecoder()
        position = 0
        while position < len(body):
            try:
                item, end = decoder.raw_decode(body, position)
            except json.JSONDecodeError:
                return text, []
            call = _call_from_object(item, "parameters")
            if call is None:
                return text, []
            calls.append(call)
            position = end
            while position < len(body) and body[position] in " \r\n\t;":
                position += 1
        return None, calls


class MistralParser(_MarkerParser):
    """`[TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]`, or the form of Mistral's newer tokenizers
    (v11+: Mistral Small 3.2, Magistral, Devstral), `[TOOL_CALLS]name[ARGS]{...}` a call, each with its
    marker (a `[CALL_ID]id` after the name passed over); text before the first marker kept."""

    marker = "[TOOL_CALLS]"
    marker_is_special = True  # in Mistral's tokenizers

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """The calls, or none and the whole text as content where any item is no call."""
        if self.marker not in text:
            return text, []
        head, tail = text.split(self.marker, 1)
        if not tail.lstrip().startswith(("[", "{")):
            calls = [_named_args_call(part) for part in tail.split(self.marker)]
            return (text, []) if None in calls else (head or None, calls)  # type: ignore[return-value]
        try:
            items = json.JSONDecoder().raw_decode(tail.strip())[0]
        except json.JSONDecodeError:
            return text, []
        items = items if isinstance(items, list) else [items]
        calls = [_call_from_object(i, "arguments") for i in items]
        if not calls or None in calls:
            return text, []
        return head or None, calls


def _named_args_call(part: str) -> ToolCall | None:
    """One `name[ARGS]{...}` call of Mistral's newer form (`name[CALL_ID]id[ARGS]{...}` too)."""
    name, found, arguments = part.partition("[ARGS]")
    name = name.partition("[CALL_ID]")[0].strip()
    if not found or not name:
        return None
    arguments = arguments.strip()
    try:
        item, end = json.JSONDecoder().raw_decode(arguments)
    except json.JSONDecodeError:
        return None
    if arguments[end:].strip():
        return None
    return _call_from_object({"name": name, "arguments": item}, "arguments")


PARSERS = {"hermes": HermesParser, "llama3_json": Llama3JsonParser, "mistral": MistralParser}


def keep_marker(params, mode: str, parser_name: str | None) -> None:
    """Under `auto`, a parser whose marker may be a special token of the model's tokenizer (Mistral's
    [TOOL_CALLS], some Hermes models' <tool_call>) needs it kept in the text: skip_special_tokens off, as
    vLLM's parsers of these names set it."""
    if mode == "auto" and getattr(PARSERS.get(parser_name or ""), "marker_is_special", False):
        params.skip_special_tokens = False
