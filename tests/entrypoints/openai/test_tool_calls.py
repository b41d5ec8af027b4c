"""Tool calling through the server with the openai client on the embedded SmolLM2 (whose chat template
knows no tools: they go into the system message): a named function and `required` are enforced with a
grammar, so the arguments parse against the schema; a round trip (call, tool result, final answer),
streamed and not; `auto` with the hermes parser; the parsers on the formats they read; bad tool
requests are 400s naming the field."""

from __future__ import annotations

import json

import jsonschema
import pytest

from tests.entrypoints.openai.conftest import MAIN_SERVER_ARGS, ServerProcess
from tests.entrypoints.openai.test_api_server import assert_error
from tokenmill.entrypoints.openai.tool_calls import HermesParser, Llama3JsonParser, MistralParser

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 30},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "The current time in a timezone.",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "maxLength": 30}},
            "required": ["zone"],
        },
    },
}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def test_named_function_round_trip(client) -> None:
    first = client.chat.completions.create(
        model="default", messages=ASK, tools=[WEATHER, TIME], max_tokens=60, temperature=0,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )  # fmt: skip
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    messages = [
        *ASK,
        choice.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 21, "sky": "clear"})},
    ]
    final = client.chat.completions.create(
        model="default",
        messages=messages,
        tools=[WEATHER, TIME],
        tool_choice="none",
        max_tokens=40,
        temperature=0,
    )
    assert final.choices[0].message.content and not final.choices[0].message.tool_calls
    stream = client.chat.completions.create(
        model="default", messages=ASK, tools=[WEATHER, TIME], max_tokens=60, temperature=0, stream=True,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )  # fmt: skip
    deltas = [c.choices[0] for c in stream if c.choices]
    streamed = [t for d in deltas for t in d.delta.tool_calls or []]
    assert [t.function.name for t in streamed] == ["get_weather"]
    assert streamed[0].function.arguments == call.function.arguments
    assert deltas[-1].finish_reason == "tool_calls"


def test_required_calls_parse_against_their_schemas(client) -> None:
    response = client.chat.completions.create(
        model="default",
        messages=ASK,
        tools=[WEATHER, TIME],
        tool_choice="required",
        max_tokens=120,
        temperature=0,
    )
    calls = response.choices[0].message.tool_calls
    assert calls and response.choices[0].finish_reason == "tool_calls"
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
    for call in calls:
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])


def test_bad_tool_requests_are_400(server) -> None:
    body = {"model": "default", "messages": ASK, "max_tokens": 5}
    cases = [
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
        ),
        ({"tool_choice": "required"}, "tool_choice"),
        (
            {"tools": [{"type": "function", "function": {}}], "tool_choice": "required"},
            "tools.0.function.name",
        ),
        ({"tools": [WEATHER]}, "tool_choice"),  # auto, and the server has no parser
        (
            {"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}},
            "tool_choice",
        ),
    ]
    for override, param in cases:
        assert_error(server.post("/v1/chat/completions", json={**body, **override}), 400, param)


def test_auto_tool_choice_with_the_hermes_parser(tmp_path) -> None:
    process = ServerProcess(
        [*MAIN_SERVER_ARGS, "--enable-auto-tool-choice", "--tool-call-parser", "hermes"],
        tmp_path / "tools.log",
    )
    try:
        client = process.wait_ready().client()
        response = client.chat.completions.create(
            model="default", messages=ASK, tools=[WEATHER, TIME], max_tokens=80, temperature=0
        )
        message = response.choices[0].message
        # The small model may answer or call; whichever it does is well formed.
        if message.tool_calls:
            assert response.choices[0].finish_reason == "tool_calls"
            for call in message.tool_calls:
                json.loads(call.function.arguments)
        else:
            assert message.content
    finally:
        process.stop()


F1 = '{"name": "f", "arguments": {"a": 1}}'
F0, G = '{"name": "f", "arguments": {}}', '{"name": "g", "arguments": {"b": "x"}}'
PARSER_CASES = [
    (HermesParser(), f"Sure.\n<tool_call>\n{F1}\n</tool_call>", "Sure.", [("f", {"a": 1})]),
    (
        HermesParser(),
        f"<tool_call>{F0}</tool_call><tool_call>{G}</tool_call>",
        None,
        [("f", {}), ("g", {"b": "x"})],
    ),
    (HermesParser(), "No tools needed.", "No tools needed.", []),
    (HermesParser(), "<tool_call>{not json}</tool_call>", "<tool_call>{not json}</tool_call>", []),
    (Llama3JsonParser(), '{"name": "f", "parameters": {"a": 1}}', None, [("f", {"a": 1})]),
    (
        Llama3JsonParser(),
        '<|python_tag|>{"name": "f", "parameters": {}}; {"name": "g", "parameters": {"c": 2}}',
        None,
        [("f", {}), ("g", {"c": 2})],
    ),
    (Llama3JsonParser(), "The answer is 4.", "The answer is 4.", []),
    (
        MistralParser(),
        '[TOOL_CALLS] [{"name": "f", "arguments": {"a": [1, 2]}}]',
        None,
        [("f", {"a": [1, 2]})],
    ),
    (
        MistralParser(),
        'Let me check. [TOOL_CALLS] [{"name": "f", "arguments": "{\\"a\\": 1}"}]',
        "Let me check.",
        [("f", {"a": 1})],
    ),
]


@pytest.mark.parametrize(("parser", "text", "content", "calls"), PARSER_CASES)
def test_parsers(parser, text, content, calls) -> None:
    got_content, got_calls = parser.parse(text)
    assert got_content == content
    assert [(c.name, json.loads(c.arguments)) for c in got_calls] == calls
