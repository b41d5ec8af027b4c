"""Structured outputs through the server with the official openai client: response_format json_schema
(plain and streamed) validates, the client's parse() fills a pydantic model, vLLM's extras (guided_choice,
structured_outputs) work on chat and completions, json_object parses."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from tests.entrypoints.openai.test_api_server import assert_error
from tests.schemas import Book

MESSAGES = [{"role": "user", "content": "Describe a book as JSON."}]
BOOK = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 40},
        "year": {"type": "integer", "minimum": 1400, "maximum": 2030},
        "genres": {"type": "array", "items": {"enum": ["novel", "poetry", "history"]}, "maxItems": 2},
    },
    "required": ["title", "year", "genres"],
    "additionalProperties": False,
}


def response_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "book", "schema": schema, "strict": True}}


def test_json_schema_plain_and_streamed(client) -> None:
    response = client.chat.completions.create(
        model="default",
        messages=MESSAGES,
        max_tokens=120,
        temperature=0,
        response_format=response_format(BOOK),
    )
    text = response.choices[0].message.content
    jsonschema.validate(json.loads(text), BOOK)
    assert response.choices[0].finish_reason == "stop"
    stream = client.chat.completions.create(
        model="default", messages=MESSAGES, max_tokens=120, temperature=0, stream=True,
        response_format=response_format(BOOK),
    )  # fmt: skip
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == text


def test_parse_fills_a_pydantic_model(client) -> None:
    completion = client.chat.completions.parse(
        model="default", messages=MESSAGES, max_tokens=150, temperature=0, response_format=Book
    )
    book = completion.choices[0].message.parsed
    assert isinstance(book, Book) and isinstance(book.year, int)


def test_vllm_extras_on_chat_and_completions(client) -> None:
    choice = client.chat.completions.create(
        model="default", messages=[{"role": "user", "content": "Is water wet?"}], max_tokens=5, temperature=0,
        extra_body={"guided_choice": ["yes", "no"]},
    )  # fmt: skip
    assert choice.choices[0].message.content in ("yes", "no")
    completion = client.completions.create(
        model="default", prompt="The year the book came out:", max_tokens=8, temperature=0,
        extra_body={"structured_outputs": {"regex": "[12][0-9]{3}"}},
    )  # fmt: skip
    assert re.fullmatch("[12][0-9]{3}", completion.choices[0].text)
    # Any JSON object: a small model may write one string until max_tokens (bf16 rounding, which the
    # prefix cache's state changes, decides which); an answer that stops is always an object.
    stopped = 0
    for prompt in ('Reply with a JSON object with a key "ok" set to true.', "Reply in JSON with your name."):
        answer = client.chat.completions.create(
            model="default", messages=[{"role": "user", "content": prompt}], max_tokens=100, temperature=0,
            response_format={"type": "json_object"},
        ).choices[0]  # fmt: skip
        assert answer.message.content.startswith("{")
        if answer.finish_reason == "stop":
            assert isinstance(json.loads(answer.message.content), dict)
            stopped += 1
    assert stopped


def test_logprobs_under_a_grammar_are_numbers(client) -> None:
    """A grammar masks most tokens to -inf before the logprobs are taken (as vLLM's do); the response
    reports them at vLLM's floor, -9999.0, not as a float JSON cannot carry."""
    regex = {"structured_outputs": {"regex": "[12][0-9]{3}"}}
    chat = dict(model="default", messages=[{"role": "user", "content": "Year?"}], max_tokens=6, temperature=0)
    answer = client.chat.completions.create(**chat, logprobs=True, top_logprobs=5, extra_body=regex)
    content = answer.choices[0].logprobs.content
    assert re.fullmatch("[12][0-9]{3}", answer.choices[0].message.content)
    assert "".join(entry.token for entry in content) == answer.choices[0].message.content
    values = [top.logprob for entry in content for top in entry.top_logprobs] + [e.logprob for e in content]
    assert all(-9999.0 <= value <= 0.0 for value in values) and -9999.0 in values
    streamed = client.chat.completions.create(
        **chat, logprobs=True, top_logprobs=5, extra_body=regex, stream=True
    )
    entries = [
        e
        for chunk in streamed
        if chunk.choices and chunk.choices[0].logprobs
        for e in chunk.choices[0].logprobs.content
    ]
    assert [e.token for e in entries] == [e.token for e in content]
    # (the same figures but for the prefix cache's rounding: the prompt is cached by now)
    assert [e.logprob for e in entries] == pytest.approx([e.logprob for e in content], abs=1e-3)
    completion = client.completions.create(
        model="default", prompt="Year:", max_tokens=6, temperature=0, logprobs=5, extra_body=regex
    )
    logprobs = completion.choices[0].logprobs
    assert all(v >= -9999.0 for top in logprobs.top_logprobs for v in top.values())
    assert all(v >= -9999.0 for v in logprobs.token_logprobs)


def test_completions_take_response_format(client, server) -> None:
    """As vLLM's completions do: OpenAI's response_format on /v1/completions, checked as on chat."""
    completion = client.completions.create(
        model="default", prompt="A book as JSON:", max_tokens=120, temperature=0,
        extra_body={"response_format": response_format(BOOK)},
    )  # fmt: skip
    jsonschema.validate(json.loads(completion.choices[0].text), BOOK)
    body = {"model": "default", "prompt": "x", "max_tokens": 2, "response_format": {"type": "bogus"}}
    assert_error(server.post("/v1/completions", json=body), 400, "response_format")


def test_grammars_in_gbnf_as_vllm_users_send_them(client, server) -> None:
    """vLLM's `grammar` (and `guided_grammar`) in the EBNF its users write for xgrammar, `root ::= ...`:
    the output parses under it; a malformed one is a 400 naming the field, and the server serves on."""
    from tests.test_grammars import SQL_GBNF

    completion = client.completions.create(
        model="default", prompt="Write a SQL query:", max_tokens=40, temperature=0,
        extra_body={"structured_outputs": {"grammar": SQL_GBNF}},
    )  # fmt: skip
    sql = r"SELECT col_[12]  from table_[12]  where col_[12] = [12] "
    assert re.fullmatch(sql, completion.choices[0].text)
    answer = client.chat.completions.create(
        model="default", messages=[{"role": "user", "content": "Is water wet?"}], max_tokens=5, temperature=0,
        extra_body={"guided_grammar": 'root ::= ("yes" | "no")'},
    )  # fmt: skip
    assert answer.choices[0].message.content in ("yes", "no")
    body = {"model": "default", "messages": MESSAGES, "max_tokens": 5}
    for field, constraint in (
        ("structured_outputs", {"structured_outputs": {"grammar": 'root ::= ( "a" '}}),
        ("guided_grammar", {"guided_grammar": "root ::= missing-rule"}),
    ):
        error = assert_error(server.post("/v1/chat/completions", json={**body, **constraint}), 400, field)
        assert "GBNF" in error["message"]
    assert server.post("/v1/chat/completions", json=body).status_code == 200


def test_vllms_json_options(client, server) -> None:
    """structured_outputs' whitespace_pattern (and the older guided_whitespace_pattern beside guided_json)
    lets the JSON hold that whitespace; disable_any_whitespace and disable_additional_properties ask for
    what the server writes anyway; an option that cannot apply is a 400 naming its field."""
    schema = {"type": "object", "properties": {"a": {"type": "integer", "maximum": 9}}, "required": ["a"]}
    chat = dict(model="default", messages=[{"role": "user", "content": "JSON, please."}], temperature=0)
    for extra in (
        {"structured_outputs": {"json": schema, "whitespace_pattern": "[ ]?"}},
        {"guided_json": schema, "guided_whitespace_pattern": "[ ]?"},
        {"structured_outputs": {"json": schema, "disable_any_whitespace": True}},
        {"structured_outputs": {"json": schema, "disable_additional_properties": True}},
    ):
        answer = client.chat.completions.create(**chat, max_tokens=20, extra_body=extra).choices[0]
        assert answer.finish_reason == "stop" and json.loads(answer.message.content)["a"] <= 9
        spaced = re.fullmatch(r"\{ ?\"a\": ?[0-9] ?\}", answer.message.content)
        assert spaced if "whitespace_pattern" in json.dumps(extra) else answer.message.content[:3] == '{"a'
    body = {"model": "default", "messages": MESSAGES, "max_tokens": 5}
    for field, extra in (
        ("structured_outputs", {"structured_outputs": {"regex": "[0-9]", "whitespace_pattern": " ?"}}),
        ("structured_outputs", {"structured_outputs": {"json": schema, "whitespace_pattern": "(("}}),
        ("guided_whitespace_pattern", {"guided_whitespace_pattern": " ?"}),
    ):
        assert_error(server.post("/v1/chat/completions", json={**body, **extra}), 400, field)
    assert server.post("/v1/chat/completions", json=body).status_code == 200


TAG = {
    "triggers": ["<function="],
    "structures": [
        {
            "begin": "<function=add>",
            "schema": {"type": "object", "properties": {"x": {"enum": [7]}}, "required": ["x"]},
            "end": "</function>",
        }
    ],
}


def test_structural_tags(client, server) -> None:
    """vLLM's structural tag as response_format ({"type": "structural_tag", ...}) and as structured_outputs'
    structural_tag (JSON text): the model writes freely, a call it opens follows the schema (x is 7, which
    the model itself would not write there); xgrammar's newer form is a 400 naming the field."""
    prompt = 'Calls:\n<function=add>{"x": 1}</function>\n<function=add>{"x": 3}</function>\n'
    free = client.completions.create(model="default", prompt=prompt, max_tokens=12, temperature=0)
    assert free.choices[0].text.startswith('<function=add>{"x": 5}')
    for extra in (
        {"response_format": {"type": "structural_tag", **TAG}},
        {"structured_outputs": {"structural_tag": json.dumps(TAG)}},
    ):
        tagged = client.completions.create(
            model="default", prompt=prompt, max_tokens=16, temperature=0, extra_body=extra
        )
        assert tagged.choices[0].text.startswith('<function=add>{"x": 7}</function>')
    body = {"model": "default", "messages": MESSAGES, "max_tokens": 5}
    newer = {"type": "structural_tag", "format": {"type": "triggered_tags", "triggers": [], "tags": []}}
    error = assert_error(server.post("/v1/chat/completions", json={**body, "response_format": newer}), 400)
    assert error["param"] == "response_format" and "'format'" in error["message"]
    bad = {"structural_tag": json.dumps({**TAG, "triggers": ["<tool>"]})}
    assert_error(
        server.post("/v1/chat/completions", json={**body, "structured_outputs": bad}),
        400,
        "structured_outputs",
    )
    assert server.post("/v1/chat/completions", json=body).status_code == 200


def test_vllms_structured_outputs_object_sent_whole(client, server) -> None:
    """A client that sends vLLM's StructuredOutputsParams whole (dataclasses.asdict: every field, nulls
    for those unset): nulls are defaults, and the fields that pick one of vLLM's backends say nothing
    here. A flag that is no bool is a 400 naming the field; both had failed the engine core's decoding,
    which took the server down."""
    whole = {
        "json": None, "regex": None, "choice": ["yes", "no"], "grammar": None, "json_object": None,
        "disable_fallback": False, "disable_any_whitespace": False, "disable_additional_properties": False,
        "whitespace_pattern": None, "structural_tag": None, "_backend": None, "_backend_was_auto": False,
    }  # fmt: skip
    answer = client.chat.completions.create(
        model="default", messages=[{"role": "user", "content": "Is water wet?"}], max_tokens=5, temperature=0,
        extra_body={"structured_outputs": whole},
    )  # fmt: skip
    assert answer.choices[0].message.content in ("yes", "no")
    body = {"model": "default", "messages": MESSAGES, "max_tokens": 5}
    for flag in ("json_object", "disable_any_whitespace"):
        bad = {"structured_outputs": {"choice": ["yes"], flag: "yes"}}
        assert_error(server.post("/v1/chat/completions", json={**body, **bad}), 400, "structured_outputs")
    assert server.post("/v1/chat/completions", json=body).status_code == 200


def test_a_schema_with_integers_past_64_bits(client) -> None:
    """A schema may hold integers msgpack cannot carry (a maximum of 10**30, a const): response_format,
    structured_outputs and a tool's parameters each reach the engine core (they had been 500s, 'can't
    serialize ints > 2**64 - 1')."""
    big = 10**30
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": big}}}
    schema["required"] = ["n"]
    chat = dict(model="default", messages=[{"role": "user", "content": "A number as JSON."}], temperature=0)
    for extra in ({"response_format": response_format(schema)}, {"structured_outputs": {"json": schema}}):
        answer = client.chat.completions.create(**chat, max_tokens=40, extra_body=extra).choices[0]
        if answer.finish_reason == "stop":
            assert 0 <= json.loads(answer.message.content)["n"] <= big
    tool = {"type": "function", "function": {"name": "count", "parameters": schema}}
    call = client.chat.completions.create(**chat, max_tokens=40, tools=[tool], tool_choice="required")
    assert call.choices[0].message.tool_calls or call.choices[0].finish_reason == "length"


def _pydantic_models() -> list:
    """Models as users write them for parse(): $defs and a recursive reference, Optional (anyOf with
    null), a discriminated union (oneOf), enums and Literal, const, pattern, formats, bounds on strings,
    numbers and lists, nested lists of objects."""
    import datetime
    import enum
    import uuid
    from typing import Literal

    from pydantic import BaseModel, Field

    class Color(enum.StrEnum):
        red = "red"
        green = "green"

    class Address(BaseModel):
        street: str = Field(max_length=30, description="The street")
        zip: str | None = Field(default=None, pattern=r"^[0-9]{5}$")

    class Person(BaseModel):
        """A person."""

        name: str = Field(max_length=20, title="Name")
        age: int = Field(ge=0, le=120)
        height: float = Field(gt=0.5, lt=2.5)
        kind: Literal["human", "robot"]
        color: Color
        address: Address | None = None
        tags: list[str] = Field(min_length=1, max_length=3)

    class Cat(BaseModel):
        pet_type: Literal["cat"]
        lives: int = Field(ge=0, le=9)

    class Dog(BaseModel):
        pet_type: Literal["dog"]
        barks: bool

    class Owner(BaseModel):
        pet: Cat | Dog = Field(discriminator="pet_type")
        since: datetime.date
        id: uuid.UUID

    class Node(BaseModel):
        label: str = Field(max_length=8)
        children: list[Node] = Field(default_factory=list, max_length=1)

    Node.model_rebuild()
    return [Person, Owner, Node]


@pytest.mark.parametrize("model", _pydantic_models(), ids=lambda m: m.__name__)
def test_parse_with_pydantic_models_as_users_write_them(client, model) -> None:
    """openai's parse() (the client turns the model into a strict json_schema): what comes back is the
    model filled in, and it validates against the model's own schema. (A recursive model can nest until
    max_tokens: a small model's; then there is nothing to parse, which the client reports.)"""
    import openai

    try:
        completion = client.chat.completions.parse(
            model="default", messages=[{"role": "user", "content": f"An example {model.__name__} as JSON."}],
            max_tokens=64 if model.__name__ == "Node" else 200, temperature=0, response_format=model,
        )  # fmt: skip
    except openai.LengthFinishReasonError:
        assert model.__name__ == "Node"
        return
    message = completion.choices[0].message
    assert isinstance(message.parsed, model)
    jsonschema.validate(json.loads(message.content), model.model_json_schema())


def test_bad_constraints_are_400s_naming_their_field(server) -> None:
    """An invalid schema, regex or choice: a 400 with an OpenAI error object naming the request field the
    constraint came from; the server serves on."""
    body = {"model": "default", "messages": MESSAGES, "max_tokens": 5}
    cases = [
        ({"response_format": response_format({"type": "objectx"})}, "response_format"),
        (
            {"response_format": response_format({"type": "integer", "minimum": 5, "maximum": 1})},
            "response_format",
        ),
        ({"response_format": response_format({"$ref": "#/$defs/Missing"})}, "response_format"),
        ({"response_format": response_format({"type": "string", "pattern": "[a-"})}, "response_format"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
        ({"response_format": {"type": "json_schema", "json_schema": {"schema": BOOK}}}, "response_format"),
        ({"response_format": {}}, "response_format"),  # no type: a 400 from OpenAI and vLLM too
        ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs"),
        ({"guided_regex": "[z-a]"}, "guided_regex"),
        ({"guided_json": "{not json"}, "guided_json"),
        ({"structured_outputs": {"choice": []}}, "structured_outputs"),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
        (
            {"guided_choice": ["a"], "guided_regex": "a"},
            "guided_choice",
        ),  # the later one of json, regex, choice, grammar
    ]
    for extra, field in cases:
        error = assert_error(server.post("/v1/chat/completions", json={**body, **extra}), 400, field)
        assert error["type"] == "invalid_request_error"
        # The message names the field the client wrote too, not the engine's structured_outputs.
        assert field == "structured_outputs" or "structured_outputs" not in error["message"], error
    assert server.post("/v1/chat/completions", json=body).status_code == 200


def test_a_schema_keyword_llguidance_would_ignore_is_a_400_naming_field_and_keyword(server) -> None:
    """uniqueItems (pydantic's set[int]) in response_format, `not` in a tool's parameters: llguidance
    compiles around them, so the output could break them; each is a 400 naming the request field, the
    keyword and where it sits. The server serves on."""
    body = {"model": "default", "messages": MESSAGES, "max_tokens": 5}
    tags = {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}
    schema = {"type": "object", "properties": {"tags": tags}, "required": ["tags"]}
    error = assert_error(
        server.post("/v1/chat/completions", json={**body, "response_format": response_format(schema)}),
        400,
        "response_format",
    )
    assert error["message"].startswith(
        "response_format: 'uniqueItems' (at #/properties/tags) is not implemented"
    )
    parameters = {"type": "object", "properties": {"n": {"type": "integer", "not": {"const": 3}}}}
    tool = {"type": "function", "function": {"name": "pick", "parameters": parameters}}
    error = assert_error(
        server.post("/v1/chat/completions", json={**body, "tools": [tool], "tool_choice": "required"}),
        400,
        "tools",
    )
    assert "'not'" in error["message"]
    assert server.post("/v1/chat/completions", json=body).status_code == 200
