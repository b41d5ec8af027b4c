"""Tool calling through the server with the openai client on the embedded SmolLM2 (whose chat template
knows no tools: they go into the system message): a named function and `required` are enforced with a
grammar, so the arguments parse against the schema; a round trip (call, tool result, final answer),
streamed and not; `auto` with the hermes parser; the parsers on the formats they read; bad tool
requests are 400s naming the field."""

from __future__ import annotations

import json
import random

import jsonschema
import pytest

from tests.entrypoints.openai.conftest import MAIN_SERVER_ARGS, ServerProcess
from tests.entrypoints.openai.test_api_server import assert_error
from tests.schemas import TIME, WEATHER
from tokenmill.entrypoints.openai.tool_calls import (
    PARSERS,
    HermesParser,
    Llama3JsonParser,
    MistralParser,
    ToolCall,
)
from tokenmill.entrypoints.openai.tool_stream import ToolStream

ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module", autouse=True)
def hermes_server(tmp_path_factory: pytest.TempPathFactory):
    """The server with auto tool choice, started as the module starts and waited for where it is used: it
    boots on the core that the tests before it leave idle (the shared server runs one torch thread)."""
    process = ServerProcess(
        [*MAIN_SERVER_ARGS, "--enable-auto-tool-choice", "--tool-call-parser", "hermes"],
        tmp_path_factory.mktemp("hermes") / "tools.log",
    )
    try:
        yield process
    finally:
        process.stop()


def test_named_function_round_trip(client) -> None:
    first = client.chat.completions.create(
        model="default", messages=ASK, tools=[WEATHER, TIME], max_tokens=60, temperature=0,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )  # fmt: skip
    choice = first.choices[0]
    # OpenAI's API ends a named function's call with stop (required and auto: tool_calls).
    assert choice.finish_reason == "stop" and choice.message.content is None
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
    # The first delta names the call, the rest carry the arguments as they are written.
    assert [t.function.name for t in streamed if t.function.name] == ["get_weather"] and streamed[0].id
    assert len(streamed) > 2 and all(t.index == 0 for t in streamed)
    assert "".join(t.function.arguments or "" for t in streamed) == call.function.arguments
    assert deltas[-1].finish_reason == "stop"


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
    single = client.chat.completions.create(
        model="default", messages=ASK, tools=[WEATHER, TIME], tool_choice="required", max_tokens=120,
        temperature=0, parallel_tool_calls=False,
    )  # fmt: skip
    assert len(single.choices[0].message.tool_calls) == 1  # the grammar allows one call only


def test_bad_tool_requests_are_400(server) -> None:
    body = {"model": "default", "messages": ASK, "max_tokens": 5}
    cases = [
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
        ),
        ({"tool_choice": "required"}, "tool_choice"),
        # tool_choice without tools, as OpenAI and vLLM refuse it ('none' is taken)
        ({"tool_choice": "auto"}, "tool_choice"),
        ({"tool_choice": "auto", "tools": []}, "tool_choice"),
        ({"tool_choice": {"type": "function", "function": {"name": "get_weather"}}}, "tool_choice"),
        (
            {"tools": [{"type": "function", "function": {}}], "tool_choice": "required"},
            "tools.0.function.name",
        ),
        ({"tools": [WEATHER]}, "tool_choice"),  # auto, and the server has no parser
        (  # a schema llguidance refuses, in a tool the grammar is made from
            {
                "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "objectx"}}}],
                "tool_choice": "required",
            },
            "tools",
        ),  # fmt: skip
        (
            {"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}},
            "tool_choice",
        ),
    ]
    bad_call = {"id": "call_1", "type": "function", "function": {"arguments": "{}"}}  # no name
    cases += [
        ({"messages": [*ASK, {"role": "assistant", "tool_calls": [bad_call]}]}, "messages.1.tool_calls"),
        ({"messages": [*ASK, {"role": "tool", "content": "21 C"}]}, "messages.1"),  # answers no call
        ({"tools": [WEATHER, WEATHER], "tool_choice": "required"}, "tools.1.function.name"),
    ]
    for override, param in cases:
        assert_error(server.post("/v1/chat/completions", json={**body, **override}), 400, param)
    assert server.post("/v1/chat/completions", json=body).status_code == 200
    assert server.post("/v1/chat/completions", json={**body, "tool_choice": "none"}).status_code == 200


def test_tools_whose_parameters_refer_to_their_definitions(client) -> None:
    """pydantic (through the openai client's pydantic_function_tool, LangChain) writes nested models as
    $defs the parameters refer to: `required` moves each tool's under the call list's own $defs."""
    import openai
    from pydantic import BaseModel, Field

    class When(BaseModel):
        day: int = Field(ge=1, le=31)
        month: int = Field(ge=1, le=12)

    class Booking(BaseModel):
        when: When
        guests: int = Field(ge=1, le=9)

    tool = openai.pydantic_function_tool(Booking)
    assert "$defs" in tool["function"]["parameters"]
    for tool_choice in ("required", {"type": "function", "function": {"name": "Booking"}}):
        answer = client.chat.completions.create(
            model="default", messages=[{"role": "user", "content": "Book a table for 2 on May 3."}],
            tools=[tool, WEATHER], tool_choice=tool_choice, max_tokens=80, temperature=0,
        )  # fmt: skip
        calls = answer.choices[0].message.tool_calls
        assert calls and answer.choices[0].finish_reason == (
            "tool_calls" if tool_choice == "required" else "stop"
        )
        for call in calls:
            if call.function.name == "Booking":
                Booking.model_validate_json(call.function.arguments)


def test_auto_tool_choice_with_the_hermes_parser(hermes_server: ServerProcess) -> None:
    client = hermes_server.wait_ready().client()
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


F1 = '{"name": "f", "arguments": {"a": 1}}'
F0, G = '{"name": "f", "arguments": {}}', '{"name": "g", "arguments": {"b": "x"}}'
PARSER_CASES = [
    (HermesParser(), f"Sure.\n<tool_call>\n{F1}\n</tool_call>", "Sure.\n", [("f", {"a": 1})]),
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
    # A call is the whole message (vLLM's rule, and the stream's): after text, the tag is content.
    (
        Llama3JsonParser(),
        'Sure <|python_tag|>{"name": "f", "parameters": {}}',
        'Sure <|python_tag|>{"name": "f", "parameters": {}}',
        [],
    ),
    (
        MistralParser(),
        '[TOOL_CALLS] [{"name": "f", "arguments": {"a": [1, 2]}}]',
        None,
        [("f", {"a": [1, 2]})],
    ),
    (
        MistralParser(),
        'Let me check. [TOOL_CALLS] [{"name": "f", "arguments": "{\\"a\\": 1}"}]',
        "Let me check. ",
        [("f", {"a": 1})],
    ),
    # A JSON answer with a "name" is no call without arguments (vLLM's parsers: content).
    (Llama3JsonParser(), '{"name": "Alice", "age": 30}', '{"name": "Alice", "age": 30}', []),
    (HermesParser(), '<tool_call>{"name": "f"}</tool_call>', '<tool_call>{"name": "f"}</tool_call>', []),
    (MistralParser(), '[TOOL_CALLS] [{"name": "f"}]', '[TOOL_CALLS] [{"name": "f"}]', []),
    # One block or item that is no call makes the whole answer content, not the others' calls alone.
    (HermesParser(), f"<tool_call>{F0}</tool_call><tool_call>{{bad</tool_call>",
     f"<tool_call>{F0}</tool_call><tool_call>{{bad</tool_call>", []),
    (HermesParser(), f"<tool_call>{F0}</tool_call><tool_call>{{\"name\": \"g\", \"argu",
     f"<tool_call>{F0}</tool_call><tool_call>{{\"name\": \"g\", \"argu", []),
    (MistralParser(), f"[TOOL_CALLS] [{F0}, {{\"nom\": 1}}]", f"[TOOL_CALLS] [{F0}, {{\"nom\": 1}}]", []),
    # Mistral's newer tokenizers (v11+): name[ARGS]{...} a call, each after its marker.
    (MistralParser(), 'Sure. [TOOL_CALLS]f[ARGS]{"a": [1, 2]}[TOOL_CALLS]g[CALL_ID]a1B2c3D4e[ARGS]{}',
     "Sure. ", [("f", {"a": [1, 2]}), ("g", {})]),
    (MistralParser(), "[TOOL_CALLS]f[ARGS]{broken", "[TOOL_CALLS]f[ARGS]{broken", []),
    (MistralParser(), "[TOOL_CALLS]f", "[TOOL_CALLS]f", []),
    # Calls separated by a carriage return and newline.
    (Llama3JsonParser(), '{"name": "f", "parameters": {}};\r\n{"name": "g", "parameters": {"c": 2}}', None,
     [("f", {}), ("g", {"c": 2})]),
]  # fmt: skip


def test_auto_keeps_the_special_token_markers_in_the_text() -> None:
    """Mistral's [TOOL_CALLS] (and some Hermes models' <tool_call>) is a special token: skipped by the
    detokenizer, the calls would come back as content. llama3_json's <|python_tag|> needs nothing."""
    from tokenmill.entrypoints.openai.tool_calls import keep_marker
    from tokenmill.sampling_params import SamplingParams

    for mode, parser, kept in [
        ("auto", "mistral", True), ("auto", "hermes", True), ("auto", "llama3_json", False),
        ("required", "mistral", False), ("named", "hermes", False), ("none", "mistral", False),
        ("auto", None, False),
    ]:  # fmt: skip
        params = SamplingParams()
        keep_marker(params, mode, parser)
        assert params.skip_special_tokens is not kept, (mode, parser)


@pytest.mark.parametrize(("parser", "text", "content", "calls"), PARSER_CASES)
def test_parsers(parser, text, content, calls) -> None:
    got_content, got_calls = parser.parse(text)
    assert got_content == content
    assert [(c.name, json.loads(c.arguments)) for c in got_calls] == calls


def _replay(stream: ToolStream, text: str) -> tuple[str, dict]:
    deltas = []
    for end in range(1, len(text) + 1):
        deltas += stream.feed(text[:end], final=False)
    deltas += stream.feed(text, final=True)
    content, calls = "", {}
    for delta in deltas:
        content += delta.get("content", "")
        for call in delta.get("tool_calls", []):
            entry = calls.setdefault(call["index"], ["", ""])
            entry[0] += call.get("function", {}).get("name") or ""
            entry[1] += call.get("function", {}).get("arguments", "")
    return content, {i: (name, json.loads(arguments)) for i, (name, arguments) in calls.items()}


@pytest.mark.parametrize(
    ("mode", "parser", "text", "content", "calls"),
    [
        ("named", None, '{"a": 1}', "", {0: ("f", {"a": 1})}),
        ("required", None, '[{"name": "f", "parameters": {"a": 1}}, {"name": "g", "parameters": {}}]', "",
         {0: ("f", {"a": 1}), 1: ("g", {})}),
        ("auto", "hermes", f"Sure.\n<tool_call>\n{F1}\n</tool_call>", "Sure.\n", {0: ("f", {"a": 1})}),
        ("auto", "hermes", "No tools here, a < b.", "No tools here, a < b.", {}),
        ("auto", "llama3_json", '{"name": "f", "parameters": {"x": 2}}', "", {0: ("f", {"x": 2})}),
        ("auto", "llama3_json", "Four.", "Four.", {}),
        ("auto", "mistral", 'Ok [TOOL_CALLS] [{"name": "f", "arguments": {}}]', "Ok ", {0: ("f", {})}),
    ],
)  # fmt: skip
def test_streamed_deltas_add_up(mode, parser, text, content, calls) -> None:
    """Fed a character at a time: the content deltas and the calls' fragments add up to the answer."""
    choice = {"type": "function", "function": {"name": "f"}} if mode == "named" else mode
    assert _replay(ToolStream(mode, choice, parser, True), text) == (content, calls)


def test_a_required_list_cut_by_max_tokens_gives_its_complete_calls_streamed_or_not() -> None:
    from tokenmill.entrypoints.openai.tool_calls import calls_from_constrained

    cut = '[{"name": "a", "parameters": {"x": 1}}, {"name": "b", "parameters": {}}, {"name": "a", "param'
    expected = [ToolCall("a", '{"x": 1}'), ToolCall("b", "{}")]
    assert calls_from_constrained(cut, "required") == expected
    _, streamed = _replay(ToolStream("required", "required", None, True), cut)
    assert streamed == {i: (c.name, json.loads(c.arguments)) for i, c in enumerate(expected)}
    assert calls_from_constrained(cut[:20], "required") == []
    # Cut before its first call is whole: no calls and no content, the grammar's JSON not shown as text.
    from tokenmill.entrypoints.openai.protocol import ChatCompletionRequest
    from tokenmill.entrypoints.openai.serving_chat import ToolAnswer

    tools = [{"type": "function", "function": {"name": n, "parameters": {}}} for n in ("a", "b")]
    request = ChatCompletionRequest(
        model="m", messages=[{"role": "user", "content": "hi"}], tools=tools, tool_choice="required"
    )
    whole = ToolAnswer(request, None).message(cut[:20], "length")
    assert whole == {"message": {"role": "assistant", "content": None}, "finish_reason": "length"}
    assert _replay(ToolStream("required", "required", None, True), cut[:20]) == ("", {})


# Arguments with nested JSON, non-ASCII text and escaped quotes; text before and after the calls.
ODD = '{"city": "東京", "note": "say \\"hi\\"", "filter": {"tags": ["a", {"b": null}], "n": 1.5}}'
OUTPUTS = [
    ("hermes", f'Let me look.\n<tool_call>\n{{"name": "f", "arguments": {ODD}}}\n</tool_call>\n'
     f'<tool_call>{{"name": "g", "arguments": {{}}}}</tool_call> done'),
    ("hermes", "<tool_call>{broken</tool_call>"),
    ("llama3_json",
     f'<|python_tag|>{{"name": "f", "parameters": {ODD}}}; {{"name": "g", "parameters": {{}}}}'),
    ("mistral",
     f'Checking. [TOOL_CALLS] [{{"name": "f", "arguments": {ODD}}}, '
     '{"name": "g", "arguments": {}, "id": "a1B2c3D4e"}]'),
    ("mistral", f'Checking. [TOOL_CALLS]f[ARGS]{ODD}[TOOL_CALLS]g[ARGS]{{}}'),
]  # fmt: skip


@pytest.mark.parametrize(("parser", "text"), OUTPUTS)
def test_streamed_in_any_chunks_is_the_whole_answer(parser, text) -> None:
    """Split into chunks of 1 to 7 characters, the deltas add up to the non-streamed content and calls,
    character for character; arguments keep non-ASCII text as written (vLLM's ensure_ascii=False)."""
    content, calls = PARSERS[parser]().parse(text)
    for seed in range(4):
        stream, deltas, end = ToolStream("auto", "auto", parser, True), [], 0
        chunk_sizes = random.Random(seed)
        while end < len(text):
            end = min(len(text), end + chunk_sizes.randint(1, 7))
            deltas += stream.feed(text[:end], final=False)
        deltas += stream.feed(text, final=True)
        streamed = [c for d in deltas for c in d.get("tool_calls", [])]
        assert "".join(d.get("content", "") for d in deltas) == (content or "")
        assert [(c["function"]["name"], c["function"]["arguments"]) for c in streamed] == list(calls)
        assert [c["index"] for c in streamed] == list(range(len(calls)))
    if calls:
        assert calls[0].arguments == json.dumps(json.loads(ODD), ensure_ascii=False)
        assert "東京" in calls[0].arguments


@pytest.mark.parametrize("parser", ["mistral", "hermes"])
def test_mistral_call_ids_are_nine_alphanumerics(parser) -> None:
    """Mistral's templates refuse other ids when the calls come back in the next request, whatever id the
    model wrote; other parsers keep OpenAI's call_ ids."""
    text = next(text for name, text in OUTPUTS if name == parser)
    streamed = [
        c for d in ToolStream("auto", "auto", parser, True).feed(text, True) for c in d.get("tool_calls", [])
    ]
    ids = [c["id"] for c in streamed] + [ToolCall("f", "{}").to_openai(parser)["id"]]
    if parser == "mistral":
        assert all(len(i) == 9 and i.isalnum() for i in ids) and "a1B2c3D4e" not in ids
    else:
        assert all(i.startswith("call_") for i in ids)


def test_a_tool_whose_parameters_are_null(client) -> None:
    """OpenAI's function takes no `parameters` for no arguments; clients that serialize every field send
    `"parameters": null` (and a null description), which vLLM takes too: the call's arguments are {}."""
    ping = {"type": "function", "function": {"name": "ping", "description": None, "parameters": None}}
    for tool_choice in ("required", {"type": "function", "function": {"name": "ping"}}):
        answer = client.chat.completions.create(
            model="default", messages=[{"role": "user", "content": "Is the service up?"}], tools=[ping],
            tool_choice=tool_choice, parallel_tool_calls=False, max_tokens=30, temperature=0,
        )  # fmt: skip
        (call,) = answer.choices[0].message.tool_calls
        assert (call.function.name, json.loads(call.function.arguments)) == ("ping", {})
