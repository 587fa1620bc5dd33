"""The typed client against a real server on the default SmolLM2-135M model: nested models, `list[Model]`,
raw schemas, streamed partial objects, typed tool calls, async, and the error cases."""

from __future__ import annotations

import asyncio
import enum
from typing import Annotated, Any, Literal

import pytest
from client_helpers import API_KEY, MODEL, consistent
from live_server import free_port
from pydantic import BaseModel, Field

from structgen.client import (
    APIConnectionError,
    AsyncClient,
    AuthenticationError,
    BadRequestError,
    Client,
    ToolRun,
    TruncatedOutputError,
)

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("idle")]

GREEDY: dict[str, Any] = {"temperature": 0, "max_tokens": 96}
# One call per round: with parallel calls allowed, the small model repeats its call until max_tokens.
TOOLS_GREEDY: dict[str, Any] = {"temperature": 0, "max_tokens": 48, "parallel_tool_calls": False}
MARIA = (
    "Maria is 34 years old, lives in Lisbon, Portugal, loves blue and plays chess and tennis. "
    "Extract her as JSON."
)


class Color(str, enum.Enum):
    RED = "red"
    GREEN = "green"
    BLUE = "blue"


class Address(BaseModel):
    city: str = Field(max_length=20)
    country: str = Field(max_length=20)


class Person(BaseModel):
    name: str = Field(max_length=20, pattern=r"^[A-Z][a-z]+$")
    age: int = Field(ge=0, le=120)
    favourite_color: Color
    nickname: str | None = None
    address: Address
    hobbies: list[str] = Field(max_length=3)


class Item(BaseModel):
    name: str = Field(max_length=12)
    price: float


CITY_SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 20}, "population": {"type": "integer"}},
    "required": ["city", "population"],
    "additionalProperties": False,
}


class City(BaseModel):
    city: str = Field(max_length=20)
    population: int


LISBON = "Lisbon has 545000 people. Give it as JSON."


def check_maria(person: Person) -> None:
    assert isinstance(person, Person)
    assert (person.name, person.age, person.favourite_color) == ("Maria", 34, Color.BLUE)
    assert (person.address.city, person.address.country) == ("Lisbon", "Portugal")
    assert len(person.hobbies) <= 3


def test_parse_a_list_of_models_and_a_raw_schema(base_url: str) -> None:
    with Client(base_url) as client:
        items = client.parse(
            Annotated[list[Item], Field(min_length=1, max_length=2)],
            prompt="A pen costs 1.5 dollars and a book costs 12 dollars. List the items as JSON.",
            **GREEDY,
        )
        assert 1 <= len(items) <= 2 and all(isinstance(item, Item) for item in items)
        assert items[0].price == 1.5
        assert client.parse(CITY_SCHEMA, prompt=LISBON, **GREEDY) == {"city": "Lisbon", "population": 545000}


def test_parse_into_a_nested_model_and_stream_the_same_value(base_url: str) -> None:
    with Client(base_url) as client:
        person = client.parse(Person, prompt=MARIA, **GREEDY)
        *partials, final = client.stream_parse(Person, prompt=MARIA, **GREEDY)
    check_maria(person)
    assert final == person
    document = final.model_dump(mode="json")
    assert len(partials) > 5 and partials[-1] == document
    assert all(isinstance(p, dict) and consistent(p, document) for p in partials)
    assert {"name": "Maria"} in partials  # a field shows before the next one begins


def test_async_client(base_url: str) -> None:
    async def main() -> tuple[Any, list[Any]]:
        async with AsyncClient(base_url) as client:
            return await asyncio.gather(
                client.parse(CITY_SCHEMA, prompt=LISBON, **GREEDY),
                collect(client.stream_parse(City, prompt=LISBON, **GREEDY)),
            )

    async def collect(stream: Any) -> list[Any]:
        return [item async for item in stream]

    raw, streamed = asyncio.run(main())
    assert raw == {"city": "Lisbon", "population": 545000}
    *partials, final = streamed
    assert final == City(city="Lisbon", population=545000)
    assert partials and all(isinstance(p, dict) and consistent(p, raw) for p in partials)


# -- errors ---------------------------------------------------------------------------------------------------


def test_a_wrong_or_missing_key_is_401(keyed_base_url: str) -> None:
    with Client(keyed_base_url, api_key="wrong") as client, pytest.raises(AuthenticationError) as caught:
        client.models()
    assert caught.value.status == 401 and "API key" in caught.value.message
    with Client(keyed_base_url, api_key=API_KEY) as client:
        assert client.models() == [MODEL]
        assert client.parse(Literal["yes", "no"], prompt="Is Rome in Italy?", **GREEDY) in ("yes", "no")


def test_a_schema_the_server_cannot_enforce_is_400(base_url: str) -> None:
    schema = {"type": "object", "properties": {"a": {"$ref": "#/$defs/Nope"}}, "required": ["a"]}
    with Client(base_url) as client, pytest.raises(BadRequestError) as caught:
        client.parse(schema, prompt="Anything.", **GREEDY)
    error = caught.value
    assert (error.status, error.code, error.param) == (400, "unsupported_schema", "response_format")
    assert "$ref" in error.message and "#/properties/a" in error.message


def test_truncation_keeps_the_raw_text(base_url: str) -> None:
    with Client(base_url) as client, pytest.raises(TruncatedOutputError) as caught:
        client.parse(Person, prompt=MARIA, temperature=0, max_tokens=6)
    assert caught.value.raw_text and caught.value.raw_text.startswith("{")


def test_server_down_is_a_connection_error() -> None:
    with Client(f"http://127.0.0.1:{free_port()}", max_retries=1) as client:
        with pytest.raises(APIConnectionError, match="cannot reach"):
            client.parse(Person, prompt=MARIA, model=MODEL)
        with pytest.raises(APIConnectionError):
            list(client.stream_parse(Person, prompt=MARIA, model=MODEL))


# -- typed tools ----------------------------------------------------------------------------------------------


def get_weather(city: Annotated[str, Field(max_length=20)]) -> dict[str, Any]:
    """Get the current weather in a city.

    Args:
        city: The city's name, e.g. Paris.
    """
    return {"city": city, "temperature_c": 21, "sky": "sunny"}


class Booking(BaseModel):
    """Book a table at a restaurant."""

    restaurant: str = Field(max_length=20)
    people: int = Field(ge=1, le=20)


WEATHER = [{"role": "user", "content": "What is the weather in Paris?"}]


def test_typed_tool_call_from_a_function(base_url: str) -> None:
    with Client(base_url) as client:
        (call,) = client.call_tools([get_weather], messages=WEATHER, tool_choice="required", **TOOLS_GREEDY)
    assert call.name == "get_weather" and isinstance(call.arguments.city, str)
    assert call.run()["sky"] == "sunny"


def test_typed_tool_call_from_a_model(base_url: str) -> None:
    prompt = "Book a table for 4 people at Luigi's."
    with Client(base_url) as client:
        calls = client.call_tools(
            [get_weather, Booking], prompt=prompt, tool_choice="Booking", **TOOLS_GREEDY
        )
    assert [c.name for c in calls] == ["Booking"]
    assert isinstance(calls[0].arguments, Booking) and 1 <= calls[0].arguments.people <= 20


def test_agent_loop_runs_the_function_and_sends_the_result_back(base_url: str) -> None:
    with Client(base_url) as client:
        run = client.call_tools(
            [get_weather],
            messages=WEATHER,
            tool_choice="required",
            run_tools=True,
            max_steps=2,
            **TOOLS_GREEDY,
        )
    assert isinstance(run, ToolRun) and 1 <= run.steps <= 2
    assert run.calls[0].result["sky"] == "sunny"
    tool_messages = [m for m in run.messages if m["role"] == "tool"]
    assert tool_messages and tool_messages[0]["tool_call_id"] == run.calls[0].id
    assert run.content is not None or run.steps == 2


def test_async_typed_tool_calls(base_url: str) -> None:
    async def lookup(city: Annotated[str, Field(max_length=20)]) -> str:
        """Look a city up."""
        return f"{city} is a city"

    async def main() -> Any:
        async with AsyncClient(base_url) as client:
            return await client.call_tools(
                [lookup], messages=WEATHER, tool_choice="lookup", run_tools=True, max_steps=1, **TOOLS_GREEDY
            )

    run = asyncio.run(main())
    assert run.calls[0].name == "lookup" and run.calls[0].result.endswith("is a city")
