"""Tool calling through the official `openai` SDK against a real uvicorn serving SmolLM2-135M: `required`, named
and parallel calls (plain and streamed) whose names are allowed and whose arguments validate, `parse()` with
`pydantic_function_tool`, a two-turn agent loop, `auto` / `none`, and the 400s for bad tool requests."""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
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
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "Current weather", "parameters": CITY},
    },
    {
        "type": "function",
        "function": {"name": "get_forecast", "description": "Forecast", "parameters": FORECAST},
    },
]
SCHEMAS = {"get_weather": CITY, "get_forecast": FORECAST}
ASK = [{"role": "user", "content": "What is the weather in Vienna and in Berlin right now?"}]


@pytest.fixture(scope="module")
def client(smollm2_engine: AsyncEngine) -> Iterator[openai.OpenAI]:
    """The SDK on a live server over the shared SmolLM2 engine (left idle afterwards)."""
    with serve(build_app(smollm2_engine, smollm2_engine.engine.tokenizer, model_name=MODEL)) as url:
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    wait_idle(smollm2_engine)


@pytest.fixture(scope="module")
def answers(client: openai.OpenAI) -> dict[str, Any]:
    """Every generating request of this module, sent at once so the engine batches them (one greedy batch
    costs about what one request does on CPU); each test then checks its own answer."""
    jobs = {
        "required": lambda: create(client, tool_choice="required"),
        "streamed": lambda: list(create(client, tool_choice="required", stream=True)),
        "named": lambda: create(
            client,
            tool_choice={"type": "function", "function": {"name": "get_forecast"}},
            parallel_tool_calls=False,
        ),
        "parsed": lambda: client.chat.completions.parse(
            model=MODEL,
            messages=[{"role": "user", "content": "Weather in Paris in celsius, please."}],
            tools=[openai.pydantic_function_tool(Weather)],
            tool_choice="required",
            temperature=0,
            max_tokens=40,
        ),
        "loop": lambda: two_turns(client),
        "allowed": lambda: create(
            client,
            tool_choice={
                "type": "allowed_tools",
                "allowed_tools": {
                    "mode": "required",
                    "tools": [{"type": "function", "function": {"name": "get_forecast"}}],
                },
            },
        ),
        "strict": lambda: create(client, tools=[strict_tool(TOOLS[1])], tool_choice="required"),
        "none": lambda: create(client, tool_choice="none", max_tokens=12),
    }
    with ThreadPoolExecutor(len(jobs)) as pool:
        futures = {name: pool.submit(job) for name, job in jobs.items()}
        return {name: future.result() for name, future in futures.items()}


def strict_tool(tool: dict[str, Any]) -> dict[str, Any]:
    return {"type": "function", "function": {**tool["function"], "strict": True}}


def create(client: openai.OpenAI, **kwargs: Any) -> Any:
    options = {"model": MODEL, "messages": ASK, "tools": TOOLS, "temperature": 0, "max_tokens": 80} | kwargs
    return client.chat.completions.create(**options)


def check_calls(calls: list[Any], allowed: set[str]) -> list[tuple[str, dict[str, Any]]]:
    """Every call names an allowed function and its arguments parse and validate; returns (name, args)."""
    out = []
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name in allowed
        arguments = json.loads(call.function.arguments)
        jsonschema.validate(arguments, SCHEMAS[call.function.name])
        out.append((call.function.name, arguments))
    assert len({c.id for c in calls}) == len(calls)
    return out


def test_required_parallel_calls(answers: dict[str, Any]) -> None:
    choice = answers["required"].choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    calls = check_calls(choice.message.tool_calls, set(SCHEMAS))
    assert len(calls) >= 2  # both cities asked for: the model makes parallel calls
    assert {"Vienna", "Berlin"} <= {args["city"] for _, args in calls}


def test_named_single_call(answers: dict[str, Any]) -> None:
    choice = answers["named"].choices[0]
    assert choice.finish_reason == "tool_calls"
    assert [name for name, _ in check_calls(choice.message.tool_calls, {"get_forecast"})] == ["get_forecast"]


def test_allowed_tools_narrow_the_calls(answers: dict[str, Any]) -> None:
    # Both tools are offered in the prompt; the choice allows only the forecast, which the weather question
    # would not pick on its own.
    choice = answers["allowed"].choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.refusal is None
    assert {name for name, _ in check_calls(choice.message.tool_calls, {"get_forecast"})} == {"get_forecast"}


def test_strict_tool_arguments_match_exactly(answers: dict[str, Any]) -> None:
    choice = answers["strict"].choices[0]
    assert choice.finish_reason == "tool_calls"
    for _, arguments in check_calls(choice.message.tool_calls, {"get_forecast"}):
        assert set(arguments) == {"city", "days"} and 1 <= arguments["days"] <= 7


def test_streamed_required_calls(answers: dict[str, Any]) -> None:
    stream = answers["streamed"]
    calls: dict[int, dict[str, Any]] = {}
    finish = None
    for chunk in stream:
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        assert not delta.content
        for piece in delta.tool_calls or ():
            if piece.index not in calls:  # the first delta of a call carries its id and name
                assert piece.id.startswith("call_") and piece.function.name in SCHEMAS
                calls[piece.index] = {"id": piece.id, "name": piece.function.name, "arguments": ""}
            else:
                assert piece.id is None and piece.function.name is None
            calls[piece.index]["arguments"] += piece.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls"
    assert sorted(calls) == list(range(len(calls))) and len(calls) >= 2
    for call in calls.values():
        jsonschema.validate(json.loads(call["arguments"]), SCHEMAS[call["name"]])
    # The same request unstreamed gives the same calls (greedy decoding).
    plain = answers["required"].choices[0].message.tool_calls
    assert [(c.function.name, json.loads(c.function.arguments)) for c in plain] == [
        (c["name"], json.loads(c["arguments"])) for c in calls.values()
    ]


class Weather(BaseModel):
    city: str
    unit: str


def test_parse_with_pydantic_function_tool(answers: dict[str, Any]) -> None:
    calls = answers["parsed"].choices[0].message.tool_calls
    assert calls and all(isinstance(c.function.parsed_arguments, Weather) for c in calls)
    assert calls[0].function.name == "Weather"


def two_turns(client: openai.OpenAI) -> tuple[Any, Any]:
    messages: list[Any] = [{"role": "user", "content": "What is the weather in Lisbon?"}]
    first = create(
        client, messages=messages, tool_choice="required", parallel_tool_calls=False, max_tokens=40
    )
    call = first.choices[0].message.tool_calls[0]
    messages.append(first.choices[0].message.model_dump(exclude_none=True))
    messages.append(
        {"role": "tool", "tool_call_id": call.id, "content": '{"temperature_c": 21, "sky": "sunny"}'}
    )
    return call, create(client, messages=messages, tool_choice="auto", max_tokens=24).choices[0]


def test_two_turn_agent_loop(answers: dict[str, Any]) -> None:
    call, second = answers["loop"]
    assert call.function.name in SCHEMAS
    assert second.message.tool_calls is None or second.message.tool_calls == []
    assert second.finish_reason in ("stop", "length") and second.message.content
    assert "21" in second.message.content or "sunny" in second.message.content.lower()


def test_none_answers_in_text(answers: dict[str, Any]) -> None:
    choice = answers["none"].choices[0]
    assert not choice.message.tool_calls and choice.message.content
    assert choice.finish_reason in ("stop", "length")


@pytest.mark.parametrize(
    ("body", "param", "message"),
    [
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
            "'nope'",
        ),
        ({"tools": [TOOLS[0], TOOLS[0]]}, "tools", "duplicate function name 'get_weather'"),
        (
            {
                "tools": [
                    {
                        "type": "function",
                        "function": {"name": "f", "parameters": {"type": "object", "required": 3}},
                    }
                ]
            },
            "tools",
            r"tools[0] (f): invalid parameters schema",
        ),
        ({"tool_choice": "required"}, "tool_choice", "no tools were given"),
        (
            {
                "tools": TOOLS,
                "tool_choice": {
                    "type": "allowed_tools",
                    "allowed_tools": {"mode": "auto", "tools": [{"name": "x"}]},
                },
            },
            "tool_choice.allowed_tools.tools",
            "'x', which is not among the tools",
        ),
        (
            {
                "tools": [
                    {
                        "type": "function",
                        "function": {
                            "name": "tag",
                            "strict": True,
                            "parameters": {
                                "type": "object",
                                "properties": {"tags": {"type": "array", "uniqueItems": True}},
                            },
                        },
                    }
                ],
                "tool_choice": "required",
            },
            "tools",
            "'tag' is strict",
        ),
        (
            {
                "tools": TOOLS,
                "tool_choice": "auto",
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "r", "schema": {"type": "string", "pattern": "^a$"}},
                },
                "guided_regex": "a",
            },
            "response_format",
            "set at most one of",
        ),
        (
            {"tools": TOOLS, "guided_regex": "[a-z]+"},
            "tool_choice",
            "combine only with a JSON response format",
        ),
    ],
)
def test_bad_tool_requests_are_400(
    client: openai.OpenAI, body: dict[str, Any], param: str, message: str
) -> None:
    response = httpx.post(
        f"{client.base_url}chat/completions", json={"model": MODEL, "messages": ASK, "max_tokens": 4, **body}
    )
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param
    assert message in error["message"]
