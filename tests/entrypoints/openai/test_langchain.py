"""LangChain's OpenAI chat model against the server: with_structured_output(PydanticModel) returns the
model filled in, and bind_tools(...) with a forced tool returns a tool call whose arguments fit."""

from __future__ import annotations

import pytest

from tests.schemas import City, GetWeather

langchain_openai = pytest.importorskip("langchain_openai")


@pytest.fixture(scope="module")
def chat_model(server):
    return langchain_openai.ChatOpenAI(
        base_url=f"{server.url}/v1",
        api_key="none",
        model="default",
        temperature=0,
        max_tokens=120,
        max_retries=0,
    )


def test_with_structured_output(chat_model) -> None:
    city = chat_model.with_structured_output(City).invoke("Describe Paris.")
    assert isinstance(city, City) and 0 <= city.population_millions <= 100


def test_bind_tools(chat_model) -> None:
    message = chat_model.bind_tools([GetWeather], tool_choice="GetWeather").invoke(
        "What is the weather in Rome?"
    )
    (call,) = message.tool_calls
    assert call["name"] == "GetWeather"
    GetWeather(**call["args"])
    required = chat_model.bind_tools([GetWeather], tool_choice="any").invoke("What is the weather in Oslo?")
    assert required.tool_calls and all(c["name"] == "GetWeather" for c in required.tool_calls)


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_with_structured_output_each_method_with_the_raw_message(chat_model, method) -> None:
    """LangChain's two methods that send the schema (response_format json_schema; a forced tool), with
    include_raw: the parsed model beside the raw message, no parsing error."""
    out = chat_model.with_structured_output(City, method=method, include_raw=True).invoke("Describe Paris.")
    assert out["parsing_error"] is None and isinstance(out["parsed"], City)
    if method == "function_calling":
        (call,) = out["raw"].tool_calls
        assert call["name"] == "City" and City(**call["args"]) == out["parsed"]
    else:
        assert City.model_validate_json(out["raw"].content) == out["parsed"]


def test_json_mode_answers_a_json_object(chat_model) -> None:
    """json_mode sends response_format json_object only (the schema is the prompt's to tell): the answer
    is a JSON object, which LangChain then checks against the model itself."""
    import json

    out = chat_model.with_structured_output(City, method="json_mode", include_raw=True).invoke(
        "Describe Paris as JSON with the keys name, country and population_millions."
    )
    assert isinstance(json.loads(out["raw"].content), dict)
    assert out["parsed"] is not None or out["parsing_error"] is not None


def test_a_tool_without_arguments(chat_model) -> None:
    """A LangChain @tool without arguments has `{"properties": {}, "type": "object"}` for parameters:
    called by name or as the one tool of `any`, its arguments are `{}` (they had been whatever object
    the model made up, a whole JSON schema once)."""
    from langchain_core.tools import tool

    @tool
    def ping() -> str:
        """Check that the service answers."""
        return "pong"

    @tool
    def get_weather(city: str) -> str:
        """The current weather in a city."""
        return "sunny"

    named = chat_model.bind_tools([get_weather, ping], tool_choice="ping").invoke("Is the service up?")
    assert [(c["name"], c["args"]) for c in named.tool_calls] == [("ping", {})]
    forced = chat_model.bind_tools([ping], tool_choice="any", parallel_tool_calls=False).invoke("Is it up?")
    assert [(c["name"], c["args"]) for c in forced.tool_calls] == [("ping", {})]
