"""Streamed Responses over the `tiny` engine: the typed events in the SDK's order with sequence numbers and
`event:` framing (no `[DONE]`), the same final response as a plain request, function-call events, `incomplete`,
the `error` event of a generation that fails mid-stream, the SDK's accumulator against a live server, and a
client that hangs up mid-stream leaving the engine idle."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import AsyncIterator, Iterator
from typing import Any, Literal

import httpx
import openai
import pytest
from live_server import serve, wait_idle
from openai.types.responses import ResponseStreamEvent
from pydantic import BaseModel, TypeAdapter
from server_helpers import AUTH, CALL_EVENTS, KEY, TEXT_EVENTS, call

from structgen.engine.async_engine import AsyncEngine
from structgen.server import build_app
from structgen.server.errors import APIError
from structgen.server.responses.events import response_events

CITY = {
    "type": "object",
    "properties": {"city": {"type": "string", "enum": ["Oslo", "Rome"]}},
    "required": ["city"],
    "additionalProperties": False,
}
TOOLS = [{"type": "function", "name": "get_weather", "parameters": CITY}]
EVENT = TypeAdapter(ResponseStreamEvent)


@pytest.fixture(scope="module")
def app(engine: AsyncEngine) -> Any:
    return build_app(engine, engine.engine.tokenizer, model_name="tiny", api_key=KEY)


def named_events(response: httpx.Response) -> list[dict[str, Any]]:
    """The events of a Responses SSE body: each an `event: <type>` line and a `data:` line, no `[DONE]`."""
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/event-stream")
    events = []
    for block in filter(None, response.text.split("\n\n")):
        name, data = block.split("\n")
        assert name.startswith("event: ") and data.startswith("data: "), block
        event = json.loads(data.removeprefix("data: "))
        assert event["type"] == name.removeprefix("event: ")
        EVENT.validate_python(event)  # the SDK's own event models
        events.append(event)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    return events


def stream(app: Any, **body: Any) -> list[dict[str, Any]]:
    return named_events(
        call(app, "POST", "/v1/responses", json={"max_output_tokens": 5, "stream": True} | body)
    )


def order(events: list[dict[str, Any]]) -> str:
    return " ".join(e["type"] for e in events) + " "


def comparable(response: dict[str, Any]) -> dict[str, Any]:
    """A response without what differs between two runs of the same request (ids, times)."""
    varying = {"id", "created_at", "completed_at"}
    output = [{k: v for k, v in item.items() if k not in ("id", "call_id")} for item in response["output"]]
    usage = response["usage"] | {"input_tokens_details": None}  # the second run hits the prefix cache
    return {k: v for k, v in response.items() if k not in varying} | {"output": output, "usage": usage}


def test_text_events_in_order_and_the_plain_answer(app: Any) -> None:
    body = {"input": "Tell me a story.", "seed": 4, "ignore_eos": True, "metadata": {"a": "b"}}
    events = stream(app, **body)
    assert re.fullmatch(
        rf"response\.created response\.in_progress {TEXT_EVENTS} response\.incomplete ", order(events)
    ), order(events)
    created = events[0]["response"]
    assert created["status"] == "in_progress" and created["output"] == [] and created["usage"] is None
    assert created["metadata"] == {"a": "b"} and events[1]["response"] == created
    final = events[-1]["response"]
    deltas = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    (item,) = final["output"]
    assert item["content"][0]["text"] == deltas == events[-4]["text"]  # output_text.done carries it whole
    assert events[2]["item"]["id"] == item["id"] == events[-2]["item"]["id"]
    assert events[-2]["item"] == item and item["status"] == "incomplete"
    assert final["status"] == "incomplete" and final["incomplete_details"] == {"reason": "max_output_tokens"}
    assert final["usage"]["output_tokens"] == 5 and final["id"] == created["id"]
    plain = call(app, "POST", "/v1/responses", json={"max_output_tokens": 5} | body).json()
    assert comparable(plain) == comparable(final)
    assert call(app, "GET", f"/v1/responses/{final['id']}").json() == final  # stored as streamed


def test_a_finished_stream_is_completed(app: Any) -> None:
    events = stream(app, input="Yes or no?", guided_choice=["yes", "no"], max_output_tokens=8)
    assert events[-1]["type"] == "response.completed"
    final = events[-1]["response"]
    assert final["status"] == "completed" and final["output"][0]["content"][0]["text"] in ("yes", "no")
    assert final["structured"]["valid"] is True


def test_function_call_events_and_the_plain_answer(app: Any) -> None:
    body = {
        "input": "Weather in Rome and Oslo?",
        "tools": TOOLS,
        "tool_choice": "required",
        "max_output_tokens": 60,
        "temperature": 0,
    }
    events = stream(app, **body)
    assert re.fullmatch(
        rf"response\.created response\.in_progress ({CALL_EVENTS} )+response\.completed ", order(events)
    ), order(events)
    final = events[-1]["response"]
    calls = final["output"]
    assert calls and all(i["type"] == "function_call" and i["status"] == "completed" for i in calls)
    for index, item in enumerate(calls):
        mine = [e for e in events if e.get("output_index") == index]
        assert mine[0]["item"] | {"arguments": item["arguments"], "status": "completed"} == item
        assert "".join(e["delta"] for e in mine if e["type"].endswith("arguments.delta")) == item["arguments"]
        assert mine[-2]["arguments"] == item["arguments"] and mine[-2]["name"] == item["name"]
        assert all(e.get("item_id", item["id"]) == item["id"] for e in mine)
        assert json.loads(item["arguments"])["city"] in ("Oslo", "Rome")
    plain = call(app, "POST", "/v1/responses", json=body).json()
    assert comparable(plain) == comparable(final)
    usage = plain["usage"]
    assert 0 < usage["input_tokens_details"]["cached_tokens"] <= usage["input_tokens"]


async def _chunks(*, fail: bool) -> AsyncIterator[dict[str, Any]]:
    yield {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}
    yield {"choices": [{"index": 0, "delta": {"content": "Hello"}}]}
    if fail:
        raise APIError(503, "the engine failed: boom", code="engine_dead", param="response_format")
    yield {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}
    yield {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}}


def _events(*, fail: bool) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    head = {
        "id": "resp_1",
        "created_at": 1,
        "model": "tiny",
        "parallel_tool_calls": True,
        "store": True,
        "temperature": 1.0,
        "top_p": 1.0,
        "text": {"format": {"type": "text"}},
        "tool_choice": "auto",
        "tools": [],
        "truncation": "disabled",
    }
    stored: list[dict[str, Any]] = []

    async def run() -> list[dict[str, Any]]:
        source = response_events(_chunks(fail=fail), head=head, cached_tokens=1, on_done=stored.append)
        return [event async for event in source]

    return asyncio.run(run()), stored


def test_a_generation_that_fails_mid_stream_ends_with_an_error_event() -> None:
    events, stored = _events(fail=True)
    assert [e["type"] for e in events][-2:] == ["response.output_text.delta", "error"]
    assert events[-1] == {
        "type": "error",
        "sequence_number": len(events) - 1,
        "code": "engine_dead",
        "message": "the engine failed: boom",
        "param": "text.format",  # in the Responses API's terms
    }
    EVENT.validate_python(events[-1])
    assert stored == []  # a failed response is not stored
    events, stored = _events(fail=False)
    assert events[-1]["type"] == "response.completed" and stored == [events[-1]["response"]]
    assert stored[0]["usage"]["input_tokens_details"]["cached_tokens"] == 1


@pytest.fixture(scope="module")
def live(engine: AsyncEngine) -> Iterator[str]:
    with serve(build_app(engine, engine.engine.tokenizer, model_name="tiny", api_key=KEY)) as url:
        yield url
    wait_idle(engine)


class Place(BaseModel):
    city: Literal["Oslo", "Rome"]


def test_the_sdk_accumulates_the_stream_into_the_plain_answer(live: str) -> None:
    client = openai.OpenAI(base_url=f"{live}/v1", api_key=KEY, max_retries=0)
    options: dict[str, Any] = {"model": "tiny", "input": "Where?", "max_output_tokens": 24, "temperature": 0}
    plain = client.responses.parse(**options, text_format=Place)
    with client.responses.stream(**options, text_format=Place) as events:
        kinds = [event.type for event in events]
        final = events.get_final_response()
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert isinstance(final.output_parsed, Place) and final.output_parsed == plain.output_parsed
    assert final.output_text == plain.output_text and final.status == plain.status == "completed"
    assert final.usage is not None and plain.usage is not None
    assert final.usage.output_tokens == plain.usage.output_tokens
    # `response.incomplete` ends a stream cut by its budget (the SDK's accumulator only finishes on completed).
    cut_options: dict[str, Any] = {
        "input": "Go on.",
        "max_output_tokens": 3,
        "extra_body": {"ignore_eos": True},
    }
    with client.responses.stream(model="tiny", **cut_options) as cut:
        last = list(cut)[-1]
    assert (
        last.type == "response.incomplete" and last.response.incomplete_details.reason == "max_output_tokens"
    )
    assert client.responses.retrieve(final.id).output_text == final.output_text
    client.responses.delete(final.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(final.id)
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(model="tiny", input="x", temperature=5)
    assert caught.value.param == "temperature"  # type: ignore[attr-defined]


def test_a_client_that_hangs_up_mid_stream_leaves_the_engine_idle(live: str, engine: AsyncEngine) -> None:
    body = {"input": "count", "max_output_tokens": 1000, "ignore_eos": True, "stream": True}
    aborted = engine.engine.stats().num_requests_aborted
    with (
        httpx.Client(base_url=live, headers=AUTH, timeout=30) as client,
        client.stream("POST", "/v1/responses", json=body) as response,
    ):
        assert response.status_code == 200
        lines = (line for line in response.iter_lines() if line.startswith("event: "))
        while next(lines) != "event: response.output_text.delta":  # mid-stream: then hang up
            pass
    wait_idle(engine)
    stats = engine.engine.stats()
    assert stats.num_requests_aborted == aborted + 1 and stats.kv_blocks_used == 0


def test_logprobs_when_included_plain_and_streamed(app: Any) -> None:
    body = {"input": "Hi", "ignore_eos": True, "seed": 2, "top_logprobs": 2}
    body |= {"include": ["message.output_text.logprobs"], "max_output_tokens": 3}
    plain = call(app, "POST", "/v1/responses", json=body).json()
    (part,) = plain["output"][0]["content"]
    assert len(part["logprobs"]) == 3 and "".join(lp["token"] for lp in part["logprobs"]) == part["text"]
    assert all(len(lp["top_logprobs"]) == 2 and lp["logprob"] <= 0 for lp in part["logprobs"])
    events = stream(app, **body)
    deltas = [e for e in events if e["type"] == "response.output_text.delta"]
    assert [lp for e in deltas for lp in e["logprobs"]] == part["logprobs"]
    done = next(e for e in events if e["type"] == "response.output_text.done")
    assert done["logprobs"] == part["logprobs"]
    # Without the include, no logprobs (top_logprobs alone asks for none, as OpenAI's).
    bare = call(app, "POST", "/v1/responses", json=body | {"include": []}).json()
    assert bare["output"][0]["content"][0]["logprobs"] == []
