"""The Responses API through the official `openai` SDK against a real uvicorn serving SmolLM2-135M:
`responses.create` / `.parse(text_format=...)` / `.stream` (text, a pydantic json_schema, json_object) with the
SDK's accumulator giving the plain answer back, function tools with `tool_choice` required / named /
allowed_tools, a two-turn tool loop through `previous_response_id` and through explicit items, `incomplete` at
`max_output_tokens`, and the SDK's error types."""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import jsonschema
import openai
import pytest
from live_server import serve, wait_idle
from pydantic import BaseModel
from server_helpers import CITY, FORECAST

from structgen.engine.async_engine import AsyncEngine
from structgen.server import build_app

pytestmark = pytest.mark.slow
MODEL = "smollm2-135m"
TOOLS: list[Any] = [
    {"type": "function", "name": "get_weather", "description": "Current weather", "parameters": CITY},
    {"type": "function", "name": "get_forecast", "description": "Forecast", "parameters": FORECAST},
]
SCHEMAS = {"get_weather": CITY, "get_forecast": FORECAST}
BOTH_CITIES = "What is the weather in Vienna and in Berlin right now?"


class Point(BaseModel):
    x: int
    y: int


@pytest.fixture(scope="module")
def client(smollm2_engine: AsyncEngine) -> Iterator[openai.OpenAI]:
    with serve(build_app(smollm2_engine, smollm2_engine.engine.tokenizer, model_name=MODEL)) as url:
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    wait_idle(smollm2_engine)


def create(client: openai.OpenAI, **kwargs: Any) -> Any:
    return client.responses.create(**({"model": MODEL, "temperature": 0, "max_output_tokens": 24} | kwargs))


def streamed(client: openai.OpenAI, **kwargs: Any) -> tuple[list[str], Any]:
    """(event types, the SDK's accumulated final response)."""
    options = {"model": MODEL, "temperature": 0, "max_output_tokens": 24} | kwargs
    with client.responses.stream(**options) as events:
        return [event.type for event in events], events.get_final_response()


def tools(client: openai.OpenAI, **kwargs: Any) -> Any:
    return create(client, **({"input": BOTH_CITIES, "tools": TOOLS, "max_output_tokens": 80} | kwargs))


@pytest.fixture(scope="module")
def answers(client: openai.OpenAI) -> dict[str, Any]:
    """Every generating request of this module, sent at once so the engine batches them (a greedy batch costs
    about what one request does on CPU); each test then checks its own answers."""
    point = {"input": "Describe one example point as JSON with integer x and y.", "max_output_tokens": 32}
    jobs = {
        "text": lambda: create(client, input="Name a fruit."),
        "text_stream": lambda: streamed(client, input="Name a fruit."),
        "parsed": lambda: client.responses.parse(model=MODEL, temperature=0, text_format=Point, **point),
        "parsed_stream": lambda: streamed(client, text_format=Point, **point),
        "json_object_stream": lambda: streamed(
            client,
            input="Reply with a JSON object with keys name and age.",
            text={"format": {"type": "json_object"}},
            max_output_tokens=40,
        ),
        "required": lambda: tools(client, tool_choice="required"),
        "required_stream": lambda: streamed(
            client, input=BOTH_CITIES, tools=TOOLS, tool_choice="required", max_output_tokens=80
        ),
        "named": lambda: tools(
            client, tool_choice={"type": "function", "name": "get_forecast"}, parallel_tool_calls=False
        ),
        "allowed": lambda: tools(
            client,
            tool_choice={
                "type": "allowed_tools",
                "mode": "required",
                "tools": [{"type": "function", "name": "get_weather"}],
            },
        ),
        "loop": lambda: two_turns(client),
        "incomplete": lambda: create(
            client, input="Count to one hundred.", max_output_tokens=4, extra_body={"ignore_eos": True}
        ),
    }
    with ThreadPoolExecutor(len(jobs)) as pool:
        futures = {name: pool.submit(job) for name, job in jobs.items()}
        return {name: future.result() for name, future in futures.items()}


def test_text_plain_and_streamed(answers: dict[str, Any]) -> None:
    plain = answers["text"]
    kinds, final = answers["text_stream"]
    assert plain.status == final.status == "completed" and plain.output_text
    assert final.output_text == plain.output_text
    # The same usage, but for prefix-cache hits: the twin request that ran second reuses the first one's blocks.
    assert final.usage.model_dump(exclude={"input_tokens_details"}) == plain.usage.model_dump(
        exclude={"input_tokens_details"}
    )
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert plain.usage.input_tokens > 0 and plain.usage.output_tokens_details.reasoning_tokens == 0
    assert plain.usage.total_tokens == plain.usage.input_tokens + plain.usage.output_tokens


def test_parse_into_a_pydantic_model_plain_and_streamed(answers: dict[str, Any]) -> None:
    parsed = answers["parsed"]
    _, final = answers["parsed_stream"]
    assert parsed.status == "completed" and isinstance(parsed.output_parsed, Point)
    assert final.output_parsed == parsed.output_parsed and final.output_text == parsed.output_text
    assert parsed.text.format.type == "json_schema" and parsed.text.format.name == "Point"


def test_json_object_streamed(answers: dict[str, Any]) -> None:
    _, final = answers["json_object_stream"]
    assert final.status == "completed" and isinstance(json.loads(final.output_text), dict)


def calls_of(response: Any, allowed: set[str]) -> list[tuple[str, dict[str, Any]]]:
    """Every output item is a function call to an allowed function whose arguments validate."""
    out = []
    for item in response.output:
        assert (
            item.type == "function_call" and item.status == "completed" and item.call_id.startswith("call_")
        )
        assert item.name in allowed
        arguments = json.loads(item.arguments)
        jsonschema.validate(arguments, SCHEMAS[item.name])
        out.append((item.name, arguments))
    return out


def test_required_calls_plain_and_streamed(answers: dict[str, Any]) -> None:
    plain = answers["required"]
    calls = calls_of(plain, set(SCHEMAS))
    assert len(calls) >= 2 and {"Vienna", "Berlin"} <= {args["city"] for _, args in calls}
    assert [t.strict for t in plain.tools] == [True, True]  # the Responses API's default
    kinds, final = answers["required_stream"]
    assert calls_of(final, set(SCHEMAS)) == calls
    assert kinds.count("response.function_call_arguments.done") == len(calls)


def test_named_and_allowed_tools(answers: dict[str, Any]) -> None:
    assert [name for name, _ in calls_of(answers["named"], {"get_forecast"})] == ["get_forecast"]
    assert calls_of(answers["allowed"], {"get_weather"})


def two_turns(client: openai.OpenAI) -> tuple[Any, Any, Any]:
    """A tool loop's second turn, through previous_response_id and through the items sent again."""
    ask = [{"role": "user", "content": "What is the weather in Lisbon?"}]
    first = tools(client, input=ask, tool_choice="required", parallel_tool_calls=False, max_output_tokens=40)
    (call,) = first.output
    result = {
        "type": "function_call_output",
        "call_id": call.call_id,
        "output": '{"temperature_c": 21, "sky": "sunny"}',
    }
    chained = tools(client, input=[result], previous_response_id=first.id, max_output_tokens=24)
    explicit = tools(client, input=[*ask, *first.output, result], max_output_tokens=24)
    return first, chained, explicit


def test_a_two_turn_tool_loop(answers: dict[str, Any]) -> None:
    first, chained, explicit = answers["loop"]
    assert first.output[0].name in SCHEMAS
    assert chained.previous_response_id == first.id
    text = chained.output_text
    assert chained.output[0].type == "message" and ("21" in text or "sunny" in text.lower()), text
    assert explicit.output_text == text and explicit.usage.input_tokens == chained.usage.input_tokens


def test_incomplete_at_max_output_tokens(answers: dict[str, Any]) -> None:
    cut = answers["incomplete"]
    assert cut.status == "incomplete" and cut.incomplete_details.reason == "max_output_tokens"
    assert cut.usage.output_tokens == 4 and cut.output_text


def test_errors_are_the_sdk_types(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as bad:
        create(client, input="x", text={"format": {"type": "xml"}})
    assert bad.value.param == "text.format.type"  # type: ignore[attr-defined]
    with pytest.raises(openai.BadRequestError) as tool:
        create(client, input="x", tools=TOOLS, tool_choice={"type": "function", "name": "nope"})
    assert tool.value.param == "tool_choice"  # type: ignore[attr-defined]
    with pytest.raises(openai.NotFoundError) as missing:
        create(client, input="x", previous_response_id="resp_missing")
    assert missing.value.param == "previous_response_id"  # type: ignore[attr-defined]
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve("resp_missing")
    with pytest.raises(openai.BadRequestError):
        client.responses.create(model=MODEL, input="x", background=True, store=False)
