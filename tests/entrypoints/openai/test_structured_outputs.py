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
