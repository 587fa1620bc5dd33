"""The client against scripted servers (`httpx.MockTransport`): request bodies, model lookup, retries, typed
errors, SSE decoding and the tool loop, for `Client` and `AsyncClient` alike."""

from __future__ import annotations

import asyncio
import email.utils
import subprocess
import sys
import time
from typing import Any

import httpx
import pytest
from client_helpers import Server, chunk, completion, run_async, sse
from pydantic import BaseModel

from structgen.client import (
    APIConnectionError,
    APIStatusError,
    AsyncClient,
    AuthenticationError,
    BadRequestError,
    InternalServerError,
    OutputValidationError,
    RateLimitError,
    ToolRun,
    TruncatedOutputError,
)
from structgen.client.retry import retry_after


class City(BaseModel):
    name: str
    population: int


def test_parse_builds_the_request_and_looks_the_model_up_once() -> None:
    server = Server(
        completion('{"name":"Oslo","population":700000}'), completion('{"name":"Rome","population":1}')
    )
    with server.client(base_url="http://server/v1/", api_key="k") as client:
        assert client.parse(City, prompt="Oslo?", temperature=0, max_tokens=32, seed=None) == City(
            name="Oslo", population=700000
        )
        client.parse(City, messages=[{"role": "system", "content": "s"}, {"role": "user", "content": "u"}])
    paths = [r.url.path for r in server.requests]
    assert paths == ["/v1/models", "/v1/chat/completions", "/v1/chat/completions"]
    assert all(r.headers["authorization"] == "Bearer k" for r in server.requests)
    first, second = server.bodies()
    assert first["model"] == "m1" and first["temperature"] == 0 and first["max_tokens"] == 32
    assert "seed" not in first  # None means "not sent"
    assert first["messages"] == [{"role": "user", "content": "Oslo?"}]
    assert first["response_format"]["json_schema"]["name"] == "City"
    assert first["response_format"]["json_schema"]["strict"] is True
    assert [m["role"] for m in second["messages"]] == ["system", "user"]


def test_an_explicit_model_skips_the_lookup_and_n_returns_a_list() -> None:
    server = Server(completion('{"value":1}', '{"value":2}'))
    assert server.client(model="mine").parse(int, prompt="n?", n=2) == [1, 2]
    assert [r.url.path for r in server.requests] == ["/v1/chat/completions"]
    assert server.bodies()[0]["model"] == "mine" and server.bodies()[0]["n"] == 2


def test_messages_xor_prompt() -> None:
    client = Server().client(model="m")
    with pytest.raises(ValueError, match="exactly one"):
        client.parse(City, prompt="a", messages=[{"role": "user", "content": "b"}])
    with pytest.raises(ValueError, match="exactly one"):
        client.parse(City)


def test_retries_honour_retry_after_then_succeed() -> None:
    server = Server(
        httpx.Response(503, json={"error": {"message": "busy"}}, headers={"Retry-After": "0"}),
        httpx.Response(429, json={"error": {"message": "slow down"}}, headers={"Retry-After": "0"}),
        completion('{"value":3}'),
    )
    assert server.client(model="m").parse(int, prompt="n?") == 3
    assert len(server.requests) == 3


@pytest.mark.parametrize(
    ("status", "kind"), [(429, RateLimitError), (500, InternalServerError), (502, InternalServerError)]
)
def test_retryable_statuses_give_up_after_max_retries(status: int, kind: type[APIStatusError]) -> None:
    replies = [httpx.Response(status, json={"error": {"message": "no"}}, headers={"Retry-After": "0"})] * 3
    server = Server(*replies)
    with pytest.raises(kind) as caught:
        server.client(model="m", max_retries=2).parse(int, prompt="n?")
    assert caught.value.status == status and caught.value.message == "no"
    assert len(server.requests) == 3


def test_client_errors_are_typed_and_not_retried() -> None:
    body = {
        "error": {
            "message": "'not' at /x",
            "type": "invalid_request_error",
            "param": "response_format",
            "code": "unsupported_schema",
        }
    }
    server = Server(
        httpx.Response(400, json=body), httpx.Response(401, json={"error": {"message": "bad key"}})
    )
    client = server.client(model="m")
    with pytest.raises(BadRequestError) as caught:
        client.parse(City, prompt="x")
    error = caught.value
    assert (error.status, error.code, error.param, error.message) == (
        400,
        "unsupported_schema",
        "response_format",
        "'not' at /x",
    )
    with pytest.raises(AuthenticationError, match="bad key"):
        client.parse(City, prompt="x")
    assert len(server.requests) == 2


def test_an_error_body_in_another_shape_keeps_its_text() -> None:
    server = Server(httpx.Response(418, text="<html>teapot</html>"))
    with pytest.raises(APIStatusError, match="teapot") as caught:
        server.client(model="m").parse(City, prompt="x")
    assert type(caught.value) is APIStatusError and caught.value.status == 418


def test_connection_errors_are_retried_then_raised() -> None:
    server = Server(*[httpx.ConnectError("refused")] * 2)
    with pytest.raises(APIConnectionError, match="refused"):
        server.client(model="m", max_retries=1).parse(City, prompt="x")
    assert len(server.requests) == 2


def test_retry_after_forms() -> None:
    assert retry_after(None) is None and retry_after("soon") is None
    assert retry_after("2.5") == 2.5 and retry_after("-3") == 0.0
    later = email.utils.formatdate(time.time() + 30, usegmt=True)
    assert 25 < (retry_after(later) or 0) <= 31


def test_truncated_and_invalid_outputs_keep_the_raw_text() -> None:
    server = Server(completion('{"name":"Os', finish_reason="length"), completion('{"name":"Oslo"}'))
    client = server.client(model="m")
    with pytest.raises(TruncatedOutputError) as truncated:
        client.parse(City, prompt="x")
    assert truncated.value.raw_text == '{"name":"Os'
    with pytest.raises(OutputValidationError) as invalid:
        client.parse(City, prompt="x")
    assert invalid.value.raw_text == '{"name":"Oslo"}' and invalid.value.errors


STREAM = [
    {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]},
    chunk('{"name":"Os'),
    chunk('lo","popu'),
    chunk('lation":7'),
    chunk("00}"),
    chunk(None, "stop"),
    "[DONE]",
]


def test_stream_parse_yields_partials_then_the_value() -> None:
    server = Server(sse(*STREAM))
    items = list(server.client(model="m").stream_parse(City, prompt="x"))
    # "population" shows once its number is closed by the brace; the last item is the validated model.
    assert items == [
        {"name": "Os"},
        {"name": "Oslo"},
        {"name": "Oslo", "population": 700},
        City(name="Oslo", population=700),
    ]
    assert server.bodies()[0]["stream"] is True


def test_stream_parse_async() -> None:
    async def collect(client: AsyncClient) -> list[Any]:
        return [item async for item in client.stream_parse(City, prompt="x")]

    assert run_async(collect, Server(sse(*STREAM)), model="m")[-1] == City(name="Oslo", population=700)


def test_stream_errors() -> None:
    error = {"error": {"message": "boom", "type": "invalid_request_error", "param": None, "code": None}}
    client = Server(
        sse(chunk('{"na'), error), sse(chunk('{"name"')), sse(*STREAM[:4], chunk(None, "length"))
    ).client(model="m")
    with pytest.raises(BadRequestError, match="boom"):
        list(client.stream_parse(City, prompt="x"))
    with pytest.raises(APIConnectionError, match="before the output finished"):
        list(client.stream_parse(City, prompt="x"))
    with pytest.raises(TruncatedOutputError):
        list(client.stream_parse(City, prompt="x"))
    with pytest.raises(ValueError, match="n must be 1"):
        list(client.stream_parse(City, prompt="x", n=2))


def test_async_parse_and_errors() -> None:
    server = Server(
        completion('{"name":"Oslo","population":1}'), httpx.Response(401, json={"error": {"message": "key"}})
    )

    async def both(client: AsyncClient) -> Any:
        city = await client.parse(City, prompt="x")
        with pytest.raises(AuthenticationError):
            await client.parse(City, prompt="x")
        return city, await client.models()

    assert run_async(both, server) == (City(name="Oslo", population=1), ["m1", "m2"])


# -- tools ----------------------------------------------------------------------------------------------------


def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


class Final(BaseModel):
    answer: int


def tool_reply(name: str, arguments: str, call_id: str = "call_1") -> dict[str, Any]:
    call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
    return completion(None, finish_reason="tool_calls", tool_calls=[call])


def test_call_tools_sends_tools_and_returns_typed_calls() -> None:
    server = Server(tool_reply("add", '{"a": 2, "b": 3}'))
    (call,) = server.client(model="m").call_tools([add, Final], prompt="2+3?", tool_choice="add")
    assert call.name == "add" and (call.arguments.a, call.arguments.b) == (2, 3) and call.run() == 5
    body = server.bodies()[0]
    assert [t["function"]["name"] for t in body["tools"]] == ["add", "Final"]
    assert body["tool_choice"] == {"type": "function", "function": {"name": "add"}}


def test_the_agent_loop_runs_tools_until_a_text_answer() -> None:
    server = Server(tool_reply("add", '{"a": 2, "b": 3}'), completion("It is 5."))
    run = server.client(model="m").call_tools([add], prompt="2+3?", tool_choice="required", run_tools=True)
    assert isinstance(run, ToolRun) and run.content == "It is 5." and run.steps == 2
    assert run.finish_reason == "stop"
    assert [c.result for c in run.calls] == [5]
    first, second = server.bodies()
    assert first["tool_choice"] == "required" and second["tool_choice"] == "auto"
    assert [m["role"] for m in second["messages"]] == ["user", "assistant", "tool"]
    assert second["messages"][2] == {"role": "tool", "tool_call_id": "call_1", "content": "5"}
    assert second["messages"][1]["tool_calls"][0]["function"]["name"] == "add"
    assert run.messages[-1] == {"role": "assistant", "content": "It is 5."}


def test_the_agent_loop_stops_at_a_model_tool_or_max_steps() -> None:
    server = Server(tool_reply("Final", '{"answer": 5}'))
    run = server.client(model="m").call_tools([add, Final], prompt="2+3?", run_tools=True)
    assert run.content is None and run.calls[0].arguments == Final(answer=5) and run.steps == 1
    assert run.finish_reason == "model_tool"
    server = Server(*[tool_reply("add", '{"a": 1, "b": 1}')] * 2)
    run = server.client(model="m").call_tools([add], prompt="loop", run_tools=True, max_steps=2)
    assert run.content is None and run.steps == 2 and len(run.calls) == 2
    assert run.finish_reason == "max_steps"
    server = Server(completion("It is", finish_reason="length"))
    run = server.client(model="m").call_tools([add], prompt="2+3?", run_tools=True)
    assert (run.content, run.finish_reason, run.calls) == ("It is", "length", [])


def test_call_tools_errors() -> None:
    client = Server(completion(None, finish_reason="length", tool_calls=[])).client(model="m")
    with pytest.raises(TruncatedOutputError):
        client.call_tools([add], prompt="x")
    with pytest.raises(ValueError, match="two tools"):
        client.call_tools([add, add], prompt="x")
    with pytest.raises(ValueError, match="at least one"):
        client.call_tools([], prompt="x")

    async def async_add(a: int, b: int) -> int:
        return a + b

    client = Server(tool_reply("async_add", '{"a": 1, "b": 2}')).client(model="m")
    with pytest.raises(TypeError, match="AsyncClient"):
        client.call_tools([async_add], prompt="x", run_tools=True)


def test_async_agent_loop_awaits_coroutine_tools() -> None:
    async def async_add(a: int, b: int) -> int:
        """Add asynchronously."""
        await asyncio.sleep(0)
        return a + b

    server = Server(tool_reply("async_add", '{"a": 1, "b": 2}'), completion("3"))

    async def agent(client: AsyncClient) -> Any:
        return await client.call_tools([async_add], prompt="1+2", run_tools=True)

    run = run_async(agent, server, model="m")
    assert run.content == "3" and run.calls[0].result == 3


def test_the_client_imports_nothing_of_the_engine() -> None:
    """The client speaks HTTP only: importing it must not pull in torch or the engine."""
    code = (
        "import sys, structgen.client\n"
        "heavy = [m for m in sys.modules if m == 'torch' or m.startswith(('structgen.engine', 'structgen.server'))]\n"
        "assert not heavy, heavy\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
