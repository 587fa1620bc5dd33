"""Resumable background streams (`background` with `stream`) over the `tiny` engine behind a real uvicorn: the
plain stream's events after `response.created` / `response.queued`, a client that leaves while the response
runs on, `GET ?stream=true&starting_after=N` replaying the rest with no gap or repeat and then following live,
cancel / delete ending every live stream with `response.cancelled`, a failure ending it with `response.failed`,
the refusals (OpenAI's error bodies), the `openai` SDK's create(stream) / retrieve(stream, starting_after), and
the event log's bounds on its own. On an engine that runs one sequence at a time: `queued` until the engine
runs the request, and the grammar of the first structured request compiled before it is queued."""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import openai
import pytest
from live_server import serve, wait_idle
from openai.types.responses import Response as SDKResponse
from openai.types.responses import ResponseStreamEvent
from pydantic import TypeAdapter
from server_helpers import AUTH, KEY, TEXT_EVENTS, assert_error, refused_generate, tiny_engine

from structgen.engine.async_engine import AsyncEngine
from structgen.server import build_app
from structgen.server.errors import APIError
from structgen.server.responses.replay import EventLog, cursor
from structgen.server.responses.store import ResponseStore, StoredResponse

SHORT = {"model": "tiny", "input": "Give me a number.", "temperature": 0, "max_output_tokens": 8}
# Runs on for a while after its client has gone (40 tokens, never ending early).
RUNNING = {"model": "tiny", "input": "Count.", "max_output_tokens": 40, "ignore_eos": True}
# Still running long after the test has cancelled it.
LONG = {"model": "tiny", "input": "Count.", "max_output_tokens": 1500, "ignore_eos": True}
EVENT = TypeAdapter(ResponseStreamEvent)


@pytest.fixture(scope="module")
def url(engine: AsyncEngine) -> Iterator[str]:
    app = build_app(engine, engine.engine.tokenizer, model_name="tiny", api_key=KEY)
    with serve(app) as base:
        yield base
    wait_idle(engine)


@pytest.fixture
def client(url: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=url, headers=AUTH, timeout=60) as http:
        yield http


def events_of(response: httpx.Response) -> Iterator[dict[str, Any]]:
    """The events of a Responses SSE body as they arrive: `event: <type>` and `data:` lines, no `[DONE]`."""
    assert response.status_code == 200, response.read()
    assert response.headers["content-type"].startswith("text/event-stream")
    name = None
    for line in response.iter_lines():
        if line.startswith("event: "):
            name = line.removeprefix("event: ")
        elif line:
            event = json.loads(line.removeprefix("data: "))
            assert event["type"] == name
            if event["type"] == "response.cancelled":  # no model of it in the SDK: its Response is checked
                SDKResponse.model_validate(event["response"])
            else:
                EVENT.validate_python(event)
            yield event


@dataclass(slots=True)
class Opened:
    """A background stream read up to some event: the events so far, and the rest as they come."""

    response: httpx.Response
    seen: list[dict[str, Any]]
    rest: Iterator[dict[str, Any]]


def start(client: httpx.Client, body: dict[str, Any], until: str) -> Opened:
    """A background stream opened and read up to its first `until` event (the caller closes it)."""
    response = client.send(
        client.build_request("POST", "/v1/responses", json=body | {"background": True, "stream": True}),
        stream=True,
    )
    events = events_of(response)
    seen = []
    for event in events:
        seen.append(event)
        if event["type"] == until:
            break
    return Opened(response, seen, events)


def replay(client: httpx.Client, response_id: str, **query: Any) -> list[dict[str, Any]]:
    with client.stream("GET", f"/v1/responses/{response_id}", params={"stream": "true", **query}) as got:
        return list(events_of(got))


def types(events: list[dict[str, Any]]) -> str:
    return " ".join(e["type"] for e in events) + " "


def numbers(events: list[dict[str, Any]]) -> list[int]:
    return [e["sequence_number"] for e in events]


def test_the_plain_stream_after_a_queued_start(client: httpx.Client) -> None:
    with client.stream("POST", "/v1/responses", json=SHORT | {"background": True, "stream": True}) as got:
        events = list(events_of(got))
    assert numbers(events) == list(range(len(events)))
    created, queued, started = events[:3]
    assert types(events[:3]) == "response.created response.queued response.in_progress "
    assert created["response"] == queued["response"]
    assert created["response"]["status"] == "queued" and created["response"]["background"] is True
    assert started["response"]["status"] == "in_progress"
    with client.stream("POST", "/v1/responses", json=SHORT | {"stream": True}) as got:
        plain = list(events_of(got))
    assert types(events[2:]) == types(plain[1:])  # from response.in_progress on, the plain stream's
    assert re.fullmatch(
        rf"response\.in_progress {TEXT_EVENTS} response\.(completed|incomplete) ", types(plain[1:])
    )
    final = events[-1]["response"]
    assert (
        final["output"][0]["content"][0]["text"] == plain[-1]["response"]["output"][0]["content"][0]["text"]
    )
    assert client.get(f"/v1/responses/{final['id']}").json() == final  # stored as its final event says
    assert replay(client, final["id"]) == events  # and replayed whole once it is over


def test_a_stream_resumes_after_any_event_with_no_gap_or_repeat(client: httpx.Client) -> None:
    opened = start(client, RUNNING, until="response.output_text.delta")
    opened.response.close()  # the client leaves; the response runs on
    seen = opened.seen
    rid, last = seen[0]["response"]["id"], seen[-1]["sequence_number"]
    rest = replay(client, rid, starting_after=last)
    assert numbers(seen + rest) == list(range(len(seen) + len(rest)))
    final = rest[-1]["response"]
    assert (
        rest[-1]["type"] == "response.incomplete" and final["usage"]["output_tokens"] == 40
    )  # ran to the end
    assert replay(client, rid) == seen + rest
    again = replay(client, rid, starting_after=last + 3)
    assert again == rest[3:]
    assert replay(client, rid, starting_after=numbers(rest)[-1]) == []  # the client that saw it all


def test_a_live_reader_follows_the_running_response(client: httpx.Client) -> None:
    opened = start(client, RUNNING, until="response.in_progress")
    seen = opened.seen
    try:
        rid = seen[0]["response"]["id"]
        follower = replay(client, rid, starting_after=1)  # joins while it runs, reads to the end
        rest = list(opened.rest)
    finally:
        opened.response.close()
    assert follower == seen[2:] + rest and follower[-1]["type"] == "response.incomplete"


@pytest.mark.parametrize("how", ["cancel", "delete"])
def test_cancel_and_delete_end_the_live_streams(client: httpx.Client, engine: AsyncEngine, how: str) -> None:
    wait_idle(engine)  # earlier tests' aborts have all landed
    aborted = engine.engine.stats().num_requests_aborted
    opened = start(client, LONG, until="response.output_text.delta")
    seen, rid = opened.seen, opened.seen[0]["response"]["id"]
    try:
        with client.stream("GET", f"/v1/responses/{rid}", params={"stream": "true"}) as second:
            follower = events_of(second)
            assert next(follower) == seen[0]
            if how == "cancel":
                assert client.post(f"/v1/responses/{rid}/cancel").json()["status"] == "cancelled"
            else:
                assert client.delete(f"/v1/responses/{rid}").json()["deleted"] is True
            rest = list(opened.rest)  # both end, at once rather than 1500 tokens later
            followed = [seen[0], *follower]
    finally:
        opened.response.close()
    for stream in (seen + rest, followed):
        assert numbers(stream) == list(range(len(stream)))
        assert stream[-1]["type"] == "response.cancelled"
        assert stream[-1]["response"]["status"] == "cancelled" and stream[-1]["response"]["id"] == rid
    wait_idle(engine, timeout=5)
    assert engine.engine.stats().num_requests_aborted == aborted + 1
    if how == "cancel":
        assert client.get(f"/v1/responses/{rid}").json() == rest[-1]["response"]
        assert replay(client, rid)[-1] == rest[-1]
    else:
        assert_error(client.get(f"/v1/responses/{rid}", params={"stream": "true"}), 404, "not found")


def test_a_failing_stream_ends_with_response_failed(
    client: httpx.Client, engine: AsyncEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The engine refuses the request once it is queued: no `in_progress`."""

    monkeypatch.setattr(engine, "generate", refused_generate)
    with client.stream("POST", "/v1/responses", json=SHORT | {"background": True, "stream": True}) as got:
        events = list(events_of(got))
    monkeypatch.undo()
    assert types(events) == "response.created response.queued response.failed "
    failed = events[-1]["response"]
    assert failed["status"] == "failed" and failed["error"]["code"] == "invalid_prompt"
    assert client.get(f"/v1/responses/{failed['id']}").json() == failed


def test_the_refusals(client: httpx.Client) -> None:
    plain = client.post("/v1/responses", json=SHORT).json()["id"]
    polled = client.post("/v1/responses", json=SHORT | {"background": True}).json()["id"]
    for rid in (plain, polled):
        error = assert_error(
            client.get(f"/v1/responses/{rid}", params={"stream": "true"}), 400, "stream=true"
        )
        assert error["param"] == "stream"
    assert_error(client.get("/v1/responses/resp_nope", params={"stream": "true"}), 404, "not found")
    with client.stream("POST", "/v1/responses", json=SHORT | {"background": True, "stream": True}) as got:
        events = list(events_of(got))
    rid, last = events[0]["response"]["id"], len(events) - 1
    for bad in ("x", "-1", str(last + 1)):
        query = {"stream": "true", "starting_after": bad}
        error = assert_error(client.get(f"/v1/responses/{rid}", params=query), 400, "starting_after")
        assert error["param"] == "starting_after"
    assert client.get(f"/v1/responses/{rid}").json() == events[-1]["response"]  # without stream: the JSON


def test_the_openai_sdk_resumes_a_background_stream(url: str) -> None:
    sdk = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)
    stream = sdk.responses.create(
        model="tiny",
        input="Count.",
        max_output_tokens=40,
        background=True,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    seen = []
    for event in stream:
        seen.append(event)
        if event.type == "response.output_text.delta":
            break
    stream.close()  # interrupted
    assert [e.type for e in seen[:2]] == ["response.created", "response.queued"]
    rid, cursor_at = seen[0].response.id, seen[-1].sequence_number
    rest = list(sdk.responses.retrieve(rid, stream=True, starting_after=cursor_at))
    every = [e.sequence_number for e in seen + rest]
    assert every == list(range(len(every)))  # no gap, no repeat
    assert rest[-1].type == "response.incomplete"
    final = rest[-1].response
    assert (
        "".join(e.delta for e in seen + rest if e.type == "response.output_text.delta") == final.output_text
    )
    assert sdk.responses.retrieve(rid).output_text == final.output_text
    # The SDK's own resume helper replays from the start and drops what the cursor saw, through its accumulator.
    with sdk.responses.stream(response_id=rid, starting_after=cursor_at) as resumed:
        assert [e.sequence_number for e in resumed] == every[len(seen) :]


def test_the_event_log_bounds() -> None:
    async def main() -> None:
        log = EventLog(max_bytes=1000)
        delta = {"type": "response.output_text.delta", "delta": "x" * 200}
        for number in range(10):  # ~300 bytes each: the oldest go
            log.append(delta | {"sequence_number": number})
        assert log.next_number == 10 and 0 < log.first_kept < 10 and log.size <= 1000
        assert cursor(log, str(log.first_kept - 1)) == log.first_kept - 1
        for dropped in (None, str(log.first_kept - 2)):
            with pytest.raises(APIError, match="no longer kept"):
                cursor(log, dropped)
        behind = log.follow(log.first_kept - 1)
        assert b'"sequence_number":%d' % log.first_kept in await anext(behind)
        for number in range(10, 20):  # the reader falls behind the kept events: its stream ends
            log.append(delta | {"sequence_number": number})
        assert [frame async for frame in behind] == []
        live = log.follow(log.next_number - 1)
        waiting = asyncio.ensure_future(anext(live))
        await asyncio.sleep(0)
        assert not waiting.done()
        log.end("response.cancelled", {"status": "cancelled"})
        assert b"response.cancelled" in await waiting
        assert [frame async for frame in live] == [] and log.done
        log.end("response.failed", {})  # the stream is over: nothing more goes in
        assert log.next_number == 21

    asyncio.run(main())


def test_the_store_drops_the_least_recently_used_finished_logs_beyond_its_budget() -> None:
    store = ResponseStore(8, log_bytes=2000)
    for name in ("a", "b", "c", "running"):
        log = EventLog()
        log.append({"type": "response.output_text.delta", "sequence_number": 0, "delta": "x" * 800})
        if name != "running":
            log.end("response.completed", {"status": "completed"})
        store.put(
            StoredResponse(response={"id": name}, input_items=[], context=[], streamed=True, events=log)
        )
    store.get("a")  # used: "b" is now the least recently used
    store.trim_logs()
    kept = {key: entry.events is not None for key in ("a", "b", "c", "running") if (entry := store.peek(key))}
    assert kept == {"a": True, "b": False, "c": False, "running": True}


@pytest.fixture(scope="module")
def single() -> Iterator[AsyncEngine]:
    """An engine that runs one sequence at a time: a second request waits in its queue."""
    engine = tiny_engine(max_num_seqs=1)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def single_client(single: AsyncEngine) -> Iterator[httpx.Client]:
    app = build_app(single, single.engine.tokenizer, model_name="tiny", api_key=KEY)
    with serve(app) as base, httpx.Client(base_url=base, headers=AUTH, timeout=60) as http:
        yield http
    wait_idle(single)


def status(client: httpx.Client, response_id: str) -> str:
    return str(client.get(f"/v1/responses/{response_id}").json()["status"])


def wait_for(condition: Any, what: str) -> None:
    deadline = time.monotonic() + 60
    while not condition():
        assert time.monotonic() < deadline, f"never {what}"
        time.sleep(0.01)


def test_the_first_structured_request_compiles_before_it_is_queued(
    single_client: httpx.Client, single: AsyncEngine
) -> None:
    """On an engine that has served no structured request (no grammar compiler yet) the POST builds the
    compiler and compiles: a schema that does not compile is a 400; one that does runs."""
    assert single.engine.structured.manager is None
    broken = {"type": "json_schema", "name": "b", "schema": {"properties": {"a": {"$ref": "#/x"}}}}
    body = SHORT | {"background": True, "text": {"format": broken}}
    error = assert_error(single_client.post("/v1/responses", json=body), 400, "$ref")
    assert (error["param"], error["code"]) == ("text.format", "unsupported_schema")
    assert single.engine.structured.manager is not None
    good = {
        "type": "json_schema",
        "name": "n",
        "schema": {"type": "object", "properties": {"n": {"type": "integer"}}},
    }
    rid = single_client.post("/v1/responses", json=body | {"text": {"format": good}}).json()["id"]
    wait_for(lambda: status(single_client, rid) not in ("queued", "in_progress"), "finished")
    assert status(single_client, rid) in ("completed", "incomplete")


def test_queued_until_the_engine_runs_it(single_client: httpx.Client, single: AsyncEngine) -> None:
    wait_idle(single)
    busy = single_client.post("/v1/responses", json=LONG | {"background": True}).json()["id"]
    wait_for(lambda: status(single_client, busy) == "in_progress", "in_progress")
    opened = start(single_client, SHORT, until="response.queued")
    try:
        rid = opened.seen[0]["response"]["id"]
        wait_for(lambda: single.engine.stats().num_waiting == 1, "waiting in the engine")
        assert status(single_client, rid) == "queued"  # the engine holds it, but does not run it yet
        single_client.post(f"/v1/responses/{busy}/cancel")
        rest = list(opened.rest)
    finally:
        opened.response.close()
    assert rest[0]["type"] == "response.in_progress" and rest[-1]["type"] in (
        "response.completed",
        "response.incomplete",
    )
