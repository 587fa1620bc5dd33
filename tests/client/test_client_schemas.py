"""Targets and tools turned into the JSON Schemas the client sends, and outputs turned back into values."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Annotated, Any, Literal

import pytest
from pydantic import BaseModel, Field, TypeAdapter

from structgen.client import OutputValidationError, as_target, as_tool
from structgen.client.targets import strict_schema
from structgen.client.tools import decode_calls, result_message, tool_choice


class Color(str, enum.Enum):
    RED = "red"
    BLUE = "blue"


class Address(BaseModel):
    city: str
    zip: str | None = None


class Person(BaseModel):
    """A person."""

    name: str = Field(max_length=10)
    age: int = Field(ge=0)
    color: Color
    address: Address
    tags: list[str] = []


@dataclass
class Point:
    x: int
    y: int


def test_a_model_is_sent_strict_and_unwrapped() -> None:
    target = as_target(Person)
    assert not target.wrapped and target.name == "Person"
    schema = target.schema
    assert schema["required"] == ["name", "age", "color", "address", "tags"]
    assert schema["additionalProperties"] is False
    assert schema["$defs"]["Address"]["required"] == ["city", "zip"]  # defaults still written (as null)
    assert schema["$defs"]["Address"]["additionalProperties"] is False
    assert schema["properties"]["name"]["maxLength"] == 10
    assert target.response_format() == {
        "type": "json_schema",
        "json_schema": {"name": "Person", "schema": schema, "strict": True},
    }
    person = target.load('{"name":"Ann","age":3,"color":"red","address":{"city":"X","zip":null},"tags":[]}')
    assert person == Person(name="Ann", age=3, color=Color.RED, address=Address(city="X"))


@pytest.mark.parametrize(
    ("target", "text", "value"),
    [
        (list[Address], '{"value":[{"city":"A","zip":null}]}', [Address(city="A")]),
        (int, '{"value": 7}', 7),
        (Literal["yes", "no"], '{"value":"no"}', "no"),
        (Color, '{"value":"blue"}', Color.BLUE),
        (TypeAdapter(list[int]), '{"value":[1,2]}', [1, 2]),
        ({"type": "array", "items": {"type": "integer"}}, '{"value":[1]}', [1]),
    ],
)
def test_non_object_types_travel_wrapped(target: Any, text: str, value: Any) -> None:
    resolved = as_target(target)
    assert resolved.wrapped
    assert resolved.schema["required"] == ["value"] and resolved.schema["type"] == "object"
    assert resolved.load(text) == value


def test_a_dataclass_is_an_object_root() -> None:
    target = as_target(Point)
    assert not target.wrapped and target.schema["required"] == ["x", "y"]
    assert target.load('{"x":1,"y":2}') == Point(1, 2)


def test_wrapping_keeps_definitions_at_the_root() -> None:
    schema = as_target(list[Address]).schema
    assert "Address" in schema["$defs"]
    assert schema["properties"]["value"]["items"] == {"$ref": "#/$defs/Address"}


def test_a_raw_schema_is_sent_as_given_and_validated_with_jsonschema() -> None:
    raw = {"type": "object", "properties": {"n": {"type": "integer", "maximum": 5}}, "required": ["n"]}
    target = as_target(raw)
    assert target.schema == raw and target.adapter is None
    assert target.load('{"n": 4}') == {"n": 4}
    with pytest.raises(OutputValidationError, match="at n") as caught:
        target.load('{"n": 9}')
    assert caught.value.raw_text == '{"n": 9}'


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("{", "not valid JSON"),
        ('{"name":"Ann"}', "does not validate as Person"),
        (None, "no content"),
    ],
)
def test_bad_outputs_keep_the_raw_text(text: str | None, words: str) -> None:
    with pytest.raises(OutputValidationError, match=words) as caught:
        as_target(Person).load(text)
    assert caught.value.raw_text == text


def test_missing_wrapper_key_is_a_validation_error() -> None:
    with pytest.raises(OutputValidationError, match="wrapper"):
        as_target(int).load("7")


def test_strict_schema_reaches_nested_objects_and_leaves_maps_alone() -> None:
    schema = {
        "type": "object",
        "properties": {
            "inner": {"anyOf": [{"type": "object", "properties": {"a": {}}}, {"type": "null"}]},
            "map": {"type": "object", "additionalProperties": {"type": "integer"}},
        },
    }
    out = strict_schema(schema)
    assert out["properties"]["inner"]["anyOf"][0] == {
        "type": "object",
        "properties": {"a": {}},
        "required": ["a"],
        "additionalProperties": False,
    }
    assert out["properties"]["map"] == schema["properties"]["map"]
    assert "required" not in schema  # the input is left alone


def test_unsupported_target_is_a_type_error() -> None:
    with pytest.raises(TypeError, match="cannot build"):
        as_target(object())


# -- tools ----------------------------------------------------------------------------------------------------


def get_weather(city: str, unit: Literal["c", "f"] = "c", days: Annotated[int, Field(ge=1, le=7)] = 1) -> str:
    """Get the weather forecast for a city.

    Longer explanation that is not part of the description.

    Args:
        city: The city's name.
        unit (str): Temperature unit.
        days: How many days ahead.
    """
    return f"{city}: sunny for {days} day(s) in {unit}"


class Answer(BaseModel):
    """The final answer to the user."""

    text: str


def test_a_function_becomes_a_tool_with_described_typed_parameters() -> None:
    tool = as_tool(get_weather)
    spec = tool.spec()
    function = spec["function"]
    assert spec["type"] == "function" and function["name"] == "get_weather" and function["strict"] is True
    assert function["description"] == "Get the weather forecast for a city."
    params = function["parameters"]
    assert params["required"] == ["city", "unit", "days"] and params["additionalProperties"] is False
    assert params["properties"]["city"]["description"] == "The city's name."
    assert params["properties"]["unit"]["enum"] == ["c", "f"]
    assert params["properties"]["unit"]["description"] == "Temperature unit."
    assert params["properties"]["days"]["maximum"] == 7


def test_a_model_becomes_a_tool_without_a_function() -> None:
    tool = as_tool(Answer)
    assert (
        tool.name == "Answer"
        and tool.description == "The final answer to the user."
        and tool.function is None
    )
    assert tool.spec()["function"]["parameters"]["required"] == ["text"]


def no_doc(x: int) -> int:
    return x


def test_tool_edge_cases() -> None:
    assert as_tool(no_doc).description is None
    with pytest.raises(TypeError, match="needs a name"):
        as_tool(lambda x: x)
    with pytest.raises(TypeError, match="function or a Pydantic model"):
        as_tool(3)

    def star(*items: int) -> None:
        """Star."""

    with pytest.raises(TypeError, match="keyword"):
        as_tool(star)

    def private(_hidden: int) -> None:
        """Private."""

    with pytest.raises(TypeError, match="cannot build an argument model"):
        as_tool(private)


def test_tool_calls_decode_into_validated_arguments_and_run() -> None:
    tools = {"get_weather": as_tool(get_weather), "Answer": as_tool(Answer)}
    message = {
        "tool_calls": [
            {
                "id": "c1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city":"Oslo"}'},
            },
            {"id": "c2", "type": "function", "function": {"name": "Answer", "arguments": '{"text":"hi"}'}},
        ]
    }
    weather, answer = decode_calls(message, tools)
    assert (weather.id, weather.name, weather.arguments.city, weather.arguments.days) == (
        "c1",
        "get_weather",
        "Oslo",
        1,
    )
    assert weather.run() == "Oslo: sunny for 1 day(s) in c"
    assert answer.arguments == Answer(text="hi")
    with pytest.raises(TypeError, match="nothing to run"):
        answer.run()
    weather.result = {"temp": 3}
    assert result_message(weather) == {"role": "tool", "tool_call_id": "c1", "content": '{"temp": 3}'}
    answer.result = Answer(text="x")
    assert result_message(answer)["content"] == '{"text":"x"}'
    assert decode_calls({"content": "just text", "tool_calls": None}, tools) == []


@pytest.mark.parametrize(
    ("name", "arguments", "words"),
    [
        ("nope", "{}", "unknown tool"),
        ("get_weather", "{", "not JSON"),
        ("get_weather", '{"city":"Oslo","days":9}', "invalid"),
    ],
)
def test_bad_tool_calls_are_validation_errors(name: str, arguments: str, words: str) -> None:
    message = {"tool_calls": [{"id": "c", "function": {"name": name, "arguments": arguments}}]}
    with pytest.raises(OutputValidationError, match=words) as caught:
        decode_calls(message, {"get_weather": as_tool(get_weather)})
    assert caught.value.raw_text == arguments


def test_tool_choice_wire_format() -> None:
    tools = {"get_weather": as_tool(get_weather)}
    assert tool_choice("required", tools) == "required"
    assert tool_choice("get_weather", tools) == {"type": "function", "function": {"name": "get_weather"}}
    with pytest.raises(ValueError, match="neither"):
        tool_choice("other", tools)
