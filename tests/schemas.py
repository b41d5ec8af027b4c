"""The schemas and tools the structured-output and tool-calling tests constrain with, kept light (pydantic
only) so that benchmarks/grammar_compile.py times the same ones on a machine without the test deps."""

from __future__ import annotations

from pydantic import BaseModel, Field

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 130},
        "email": {"type": "string", "pattern": "^[a-z]{1,12}@[a-z]{1,12}\\.com$"},
        "address": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 20},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            },
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 10}, "minItems": 1, "maxItems": 3},
    },
    "required": ["name", "age", "email", "address", "role", "tags"],
    "additionalProperties": False,
}

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


class Book(BaseModel):
    title: str
    year: int
    in_print: bool


class City(BaseModel):
    name: str
    country: str
    # Bounded: a 135M model asked for a float writes digits until max_tokens.
    population_millions: int = Field(ge=0, le=100)


class GetWeather(BaseModel):
    """The current weather in a city."""

    city: str
    unit: str
