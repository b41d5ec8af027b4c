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
