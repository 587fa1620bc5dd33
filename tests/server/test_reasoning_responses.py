"""The Responses API from a reasoning model (`serve --reasoning-parser deepseek_r1`, `tiny-thinking`): a
`reasoning` output item (the SDK's `ResponseReasoningItem`) before the answer's items, its stream events
(`response.reasoning_text.delta` / `.done` inside its own item), the official SDK's create and stream (its
accumulator keeps the item), `usage.output_tokens_details.reasoning_tokens`, the request's `reasoning` echoed,
and reasoning items sent back in later turns (explicit items or `previous_response_id`): accepted, listed, and
left to the template, which drops an earlier turn's reasoning from the prompt."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import jsonschema
import openai
import pytest
from live_server import serve, wait_idle
from openai.types.responses import Response, ResponseReasoningItem, ResponseStreamEvent
from pydantic import TypeAdapter
from server_helpers import CALL_EVENTS, CITY, KEY, TEXT_EVENTS, assert_error, call

from structgen.engine.async_engine import AsyncEngine

MODEL = "tiny-thinking"
BUDGET = 10
SCHEMA = {
    "type": "object",
    "properties": {"n": {"type": "integer"}},
    "required": ["n"],
    "additionalProperties": False,
}
FORMAT = {"format": {"type": "json_schema", "name": "out", "schema": SCHEMA, "strict": True}}
SHAPED = {
    "input": "Give me a number.",
    "text": FORMAT,
    "thinking_token_budget": BUDGET,
    "max_output_tokens": 48,
    "temperature": 1.0,
    "seed": 5,
}
EVENT = TypeAdapter(ResponseStreamEvent)
REASONING_EVENTS = (
    r"response\.output_item\.added response\.content_part\.added (response\.reasoning_text\.delta )+"
    r"response\.reasoning_text\.done response\.content_part\.done response\.output_item\.done"
)
MARKERS = ("<think>", "</think>")


def create(thinking_app: Any, body: dict[str, Any]) -> dict[str, Any]:
    response = call(thinking_app, "POST", "/v1/responses", json=body)
    assert response.status_code == 200, response.text
    Response.model_validate(response.json())  # the SDK's own model
    return response.json()


def stream(thinking_app: Any, body: dict[str, Any]) -> list[dict[str, Any]]:
    response = call(thinking_app, "POST", "/v1/responses", json=body | {"stream": True})
    assert response.status_code == 200, response.text
    events = []
    for block in filter(None, response.text.split("\n\n")):
        _, data = block.split("\n")
        event = json.loads(data.removeprefix("data: "))
        EVENT.validate_python(event)
        events.append(event)
    return events


def order(events: list[dict[str, Any]]) -> str:
    return " ".join(e["type"] for e in events) + " "


def without_ids(response: dict[str, Any]) -> dict[str, Any]:
    varying = {"id", "created_at", "completed_at"}
    output = [{k: v for k, v in item.items() if k not in ("id", "call_id")} for item in response["output"]]
    return {k: v for k, v in response.items() if k not in varying} | {"output": output}


def reasoning_text(item: dict[str, Any]) -> str:
    (part,) = item["content"]
    assert part["type"] == "reasoning_text"
    return str(part["text"])


def test_a_reasoning_item_comes_before_the_answer(thinking_app: Any) -> None:
    body = create(thinking_app, SHAPED | {"reasoning": {"effort": "low"}})
    assert [item["type"] for item in body["output"]] == ["reasoning", "message"]
    reasoning, message = body["output"]
    item = ResponseReasoningItem.model_validate(reasoning)
    assert item.id.startswith("rs_") and item.summary == [] and item.status == "completed"
    assert item.content and item.content[0].text == reasoning_text(reasoning) != ""
    answer = message["content"][0]["text"]
    jsonschema.validate(json.loads(answer), SCHEMA)
    assert not any(marker in text for marker in MARKERS for text in (answer, reasoning_text(reasoning)))
    assert body["status"] == "completed" and body["structured"]["valid"] is True
    # The budget's tokens and the forced `</think>`.
    assert body["usage"]["output_tokens_details"] == {"reasoning_tokens": BUDGET + 1}
    assert body["reasoning"] == {"effort": "low", "summary": None}  # echoed, not acted on
    assert call(thinking_app, "GET", f"/v1/responses/{body['id']}").json() == body


def test_the_stream_has_the_reasoning_events_and_ends_as_the_plain_answer(thinking_app: Any) -> None:
    events = stream(thinking_app, SHAPED)
    assert re.fullmatch(
        rf"response\.created response\.in_progress {REASONING_EVENTS} {TEXT_EVENTS} response\.completed ",
        order(events),
    ), order(events)
    final = events[-1]["response"]
    reasoning = final["output"][0]
    mine = [e for e in events if e.get("output_index") == 0]
    deltas = "".join(e["delta"] for e in mine if e["type"] == "response.reasoning_text.delta")
    done = next(e for e in mine if e["type"] == "response.reasoning_text.done")
    assert deltas == done["text"] == reasoning_text(reasoning)
    assert mine[0]["item"] == reasoning | {"content": [], "status": "in_progress"}
    assert all(e.get("item_id", reasoning["id"]) == reasoning["id"] for e in mine)
    assert mine[-1]["item"] == reasoning
    assert final["usage"]["output_tokens_details"] == {"reasoning_tokens": BUDGET + 1}
    plain = create(thinking_app, SHAPED)
    assert without_ids(plain) | {"usage": None} == without_ids(final) | {"usage": None}
    assert plain["usage"]["output_tokens"] == final["usage"]["output_tokens"]


def test_the_answers_logprobs_leave_the_reasoning_out(thinking_app: Any) -> None:
    body = SHAPED | {"seed": 12, "include": ["message.output_text.logprobs"], "top_logprobs": 1}
    plain = create(thinking_app, body)
    final = stream(thinking_app, body)[-1]["response"]
    logprobs = plain["output"][1]["content"][0]["logprobs"]
    usage = plain["usage"]
    assert len(logprobs) == usage["output_tokens"] - usage["output_tokens_details"]["reasoning_tokens"]
    assert final["output"][1]["content"][0]["logprobs"] == logprobs


def test_an_output_cut_in_its_reasoning_is_incomplete_with_an_empty_message(thinking_app: Any) -> None:
    body = {"input": "Think.", "max_output_tokens": 4, "seed": 1, "temperature": 1.0}
    events = stream(thinking_app, body)
    assert re.fullmatch(
        rf"response\.created response\.in_progress {REASONING_EVENTS} {TEXT_EVENTS.replace('+', '*')} "
        r"response\.incomplete ",
        order(events),
    ), order(events)
    final = events[-1]["response"]
    reasoning, message = final["output"]
    assert reasoning["status"] == message["status"] == "incomplete"
    assert message["content"][0]["text"] == "" and reasoning_text(reasoning)
    assert final["usage"]["output_tokens_details"] == {"reasoning_tokens": 4}
    plain = create(thinking_app, body)
    assert without_ids(plain) | {"usage": None} == without_ids(final) | {"usage": None}


def test_function_calls_follow_the_reasoning(thinking_app: Any) -> None:
    tools = [{"type": "function", "name": "get_weather", "parameters": CITY}]
    body = {
        "input": "Weather in Oslo?",
        "tools": tools,
        "tool_choice": "required",
        "thinking_token_budget": 6,
        "max_output_tokens": 60,
        "temperature": 0,
    }
    events = stream(thinking_app, body)
    assert re.fullmatch(
        rf"response\.created response\.in_progress {REASONING_EVENTS} ({CALL_EVENTS} )+response\.completed ",
        order(events),
    ), order(events)
    output = events[-1]["response"]["output"]
    assert output[0]["type"] == "reasoning" and all(i["type"] == "function_call" for i in output[1:])
    for item in output[1:]:
        jsonschema.validate(json.loads(item["arguments"]), CITY)


def test_thinking_off_leaves_only_the_message(thinking_app: Any) -> None:
    body = create(thinking_app, SHAPED | {"chat_template_kwargs": {"enable_thinking": False}})
    (message,) = body["output"]
    jsonschema.validate(json.loads(message["content"][0]["text"]), SCHEMA)
    assert body["usage"]["output_tokens_details"] == {"reasoning_tokens": 0}


def test_reasoning_items_sent_back_are_accepted_and_left_out_of_the_prompt(thinking_app: Any) -> None:
    first = create(thinking_app, SHAPED)
    follow_up = {"role": "user", "content": "Another one."}
    user = {"role": "user", "content": SHAPED["input"]}
    short = {"max_output_tokens": 4, "thinking_token_budget": 2}
    chained = create(thinking_app, {"input": [follow_up], "previous_response_id": first["id"]} | short)
    explicit = create(thinking_app, {"input": [user, *first["output"], follow_up]} | short)
    answer_only = create(thinking_app, {"input": [user, first["output"][1], follow_up]} | short)
    # Qwen3's template keeps no reasoning of turns before the last user message: the same prompt all three ways.
    assert chained["usage"]["input_tokens"] == explicit["usage"]["input_tokens"]
    assert explicit["usage"]["input_tokens"] == answer_only["usage"]["input_tokens"]
    listed = call(thinking_app, "GET", f"/v1/responses/{explicit['id']}/input_items?order=asc").json()["data"]
    assert [item["type"] for item in listed] == ["message", "reasoning", "message", "message"]
    sent = first["output"][0]
    assert {k: v for k, v in listed[1].items() if k != "encrypted_content"} == {
        "id": sent["id"],
        "type": "reasoning",
        "summary": [],
        "content": sent["content"],
        "status": "completed",
    }


@pytest.mark.parametrize(
    ("item", "param"),
    [
        ({"encrypted_content": "gAAAA"}, "input[0].encrypted_content"),
        ({"content": [{"type": "output_text", "text": "x"}]}, "input[0].content"),
        ({"summary": "x"}, "input[0].summary"),
    ],
)
def test_a_bad_reasoning_item_is_a_400_naming_it(thinking_app: Any, item: dict[str, Any], param: str) -> None:
    reasoning = {"type": "reasoning", "id": "rs_1", "summary": []} | item
    body = {"input": [reasoning, {"role": "user", "content": "Hi"}], "max_output_tokens": 2}
    error = assert_error(call(thinking_app, "POST", "/v1/responses", json=body), 400)
    assert error["param"] == param


@pytest.fixture(scope="module")
def client(thinking_engine: AsyncEngine, thinking_app: Any) -> Iterator[openai.OpenAI]:
    with serve(thinking_app) as url:
        yield openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)
    wait_idle(thinking_engine)


def test_the_sdk_reads_and_accumulates_the_reasoning_item(client: openai.OpenAI) -> None:
    options: dict[str, Any] = {
        "model": MODEL,
        "input": "Name a color.",
        "text": FORMAT,  # closed at the budget: completed, which the SDK's accumulator needs
        "max_output_tokens": 32,
        "temperature": 0,
        "reasoning": {"effort": "medium"},
        "extra_body": {"thinking_token_budget": 8},
    }
    plain = client.responses.create(**options)
    with client.responses.stream(**options) as events:
        kinds = [event.type for event in events]
        final = events.get_final_response()
    assert "response.reasoning_text.delta" in kinds and kinds[-1] == "response.completed"
    for response in (plain, final):
        item = response.output[0]
        assert isinstance(item, ResponseReasoningItem) and item.content
        assert response.reasoning is not None and response.reasoning.effort == "medium"
        assert response.usage is not None and response.usage.output_tokens_details.reasoning_tokens == 9
    assert final.output[0].content[0].text == plain.output[0].content[0].text  # type: ignore[union-attr]
    assert final.output_text == plain.output_text
    # The SDK sends the item back as it got it: accepted in a follow-up.
    follow_up = client.responses.create(
        model=MODEL,
        input=[
            *[item.model_dump(exclude_none=True) for item in plain.output],
            {"role": "user", "content": "Why?"},
        ],
        max_output_tokens=2,
    )
    assert follow_up.status in ("completed", "incomplete")
