"""Background responses (`background: true`) over the `tiny` engine behind a real uvicorn (an ASGI call per
event loop would end the loop, and the task with it): queued at once, then the plain answer on poll; cancel
(idempotent, aborting the engine request), cancel refusals, delete and shutdown while running, failures in the
engine as `status: "failed"` with an error, what the pipeline refuses before the engine runs as the plain
request's 400 on the POST, the refusals, the store never evicting a running response, and the `openai` SDK's
create / retrieve / cancel. Streamed background responses: `test_responses_resume.py`."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from live_server import serve, wait_idle
from openai.types.responses import Response as SDKResponse
from server_helpers import AUTH, KEY, assert_error, call, refused_generate

from structgen.engine.async_engine import AsyncEngine
from structgen.server import ServerLimits, build_app

GREEDY = {"model": "tiny", "input": "Give me a number.", "temperature": 0, "max_output_tokens": 8}
# Still running long after the test has cancelled it (the tiny engine's KV cache holds 2048 tokens).
LONG = {"model": "tiny", "input": "Count.", "max_output_tokens": 1500, "ignore_eos": True}
BROKEN = {
    "type": "json_schema",
    "name": "b",
    "schema": {"type": "object", "properties": {"a": {"$ref": "#/x"}}},
}
# A strict function tool whose parameters no grammar enforces exactly.
LOOSE_TOOL = {
    "type": "function",
    "name": "f",
    "parameters": {"type": "object", "properties": {"a": {"$ref": "#/nope"}}},
}
# Longer than the tiny engine's whole KV cache: the engine refuses it as it adds the request.
TOO_LONG = "Count. " * 2000


@pytest.fixture(scope="module")
def app(engine: AsyncEngine) -> Any:
    return build_app(engine, engine.engine.tokenizer, model_name="tiny", api_key=KEY)


@pytest.fixture(scope="module")
def url(app: Any, engine: AsyncEngine) -> Iterator[str]:
    with serve(app) as base:
        yield base
    wait_idle(engine)


@pytest.fixture
def client(url: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=url, headers=AUTH, timeout=30) as http:
        yield http


def post(client: httpx.Client, **body: Any) -> dict[str, Any]:
    response = client.post("/v1/responses", json=body)
    assert response.status_code == 200, response.text
    data = response.json()
    SDKResponse.model_validate(data)
    return data


def background(client: httpx.Client, **body: Any) -> dict[str, Any]:
    data = post(client, **body, background=True)
    assert data["status"] == "queued" and data["background"] is True, data
    assert data["output"] == [] and data["usage"] is None and data["error"] is None
    return data


def poll(client: httpx.Client, response_id: str, timeout: float = 60) -> dict[str, Any]:
    """The response once it has left `queued` / `in_progress`."""
    deadline = time.monotonic() + timeout
    while True:
        data = client.get(f"/v1/responses/{response_id}").json()
        if data["status"] not in ("queued", "in_progress"):
            SDKResponse.model_validate(data)
            return data
        assert time.monotonic() < deadline, f"{response_id} still {data['status']}"
        time.sleep(0.05)


def reaches_the_engine(engine: AsyncEngine, timeout: float = 30) -> None:
    """Wait until the engine holds a request: a background response cancelled before its task added its engine
    request has nothing to abort, which a test counting aborts must not race."""
    deadline = time.monotonic() + timeout
    while not engine.engine.has_unfinished():
        assert time.monotonic() < deadline, "the background response never reached the engine"
        time.sleep(0.01)


def text_of(response: dict[str, Any]) -> str:
    return "".join(
        part["text"] for item in response["output"] if item["type"] == "message" for part in item["content"]
    )


def test_a_background_response_ends_as_the_plain_answer(client: httpx.Client, engine: AsyncEngine) -> None:
    queued = background(client, **GREEDY)
    done = poll(client, queued["id"])
    plain = post(client, **GREEDY)
    assert done["status"] == plain["status"] and done["background"] is True and plain["background"] is False
    assert text_of(done) == text_of(plain)
    counts = (
        "input_tokens",
        "output_tokens",
        "total_tokens",
    )  # not cached_tokens: the second finds the first's
    assert [done["usage"][key] for key in counts] == [plain["usage"][key] for key in counts]
    assert done["incomplete_details"] == plain["incomplete_details"] and done["error"] is None
    assert done["id"] == queued["id"] and done["created_at"] == queued["created_at"]
    listed = client.get(f"/v1/responses/{queued['id']}/input_items").json()["data"]
    assert [item["content"][0]["text"] for item in listed] == ["Give me a number."]
    follow = post(client, **(GREEDY | {"input": "Another.", "previous_response_id": queued["id"]}))
    assert follow["usage"]["input_tokens"] > plain["usage"]["input_tokens"]  # the conversation carried over


def test_cancel_aborts_the_engine_request_and_is_idempotent(
    client: httpx.Client, engine: AsyncEngine
) -> None:
    wait_idle(engine)
    aborted = engine.engine.stats().num_requests_aborted
    rid = background(client, **LONG)["id"]
    reaches_the_engine(engine)
    assert client.get(f"/v1/responses/{rid}").json()["status"] in ("queued", "in_progress")
    error = assert_error(
        client.post("/v1/responses", json=GREEDY | {"previous_response_id": rid}), 400, "running"
    )
    assert error["param"] == "previous_response_id"
    cancelled = client.post(f"/v1/responses/{rid}/cancel")
    assert cancelled.status_code == 200 and cancelled.json()["status"] == "cancelled"
    wait_idle(engine, timeout=5)  # aborted at once, not 1500 tokens later
    assert engine.engine.stats().num_requests_aborted == aborted + 1
    again = client.post(f"/v1/responses/{rid}/cancel")
    assert again.status_code == 200 and again.json() == cancelled.json()
    assert client.get(f"/v1/responses/{rid}").json() == cancelled.json()


def test_cancel_refuses_finished_and_plain_responses(client: httpx.Client) -> None:
    rid = background(client, **GREEDY)["id"]
    poll(client, rid)
    assert_error(client.post(f"/v1/responses/{rid}/cancel"), 400, "Cannot cancel a")
    plain = post(client, **GREEDY)
    error = assert_error(client.post(f"/v1/responses/{plain['id']}/cancel"), 400, "background")
    assert error["code"] == "not_background"
    assert_error(client.post("/v1/responses/resp_nope/cancel"), 404, "not found")


def test_background_needs_store(client: httpx.Client) -> None:
    error = assert_error(
        client.post("/v1/responses", json=GREEDY | {"store": False, "background": True}), 400, "store=true"
    )
    assert error["param"] == "background"


@pytest.mark.parametrize(
    ("extra", "param", "code"),
    [
        ({"text": {"format": BROKEN}}, "text.format", "unsupported_schema"),  # fails to compile
        ({"tools": [LOOSE_TOOL]}, "tools", "invalid_tools"),
        ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs", "invalid_value"),
    ],
)
@pytest.mark.parametrize("stream", [False, True])
def test_what_the_pipeline_refuses_is_a_400_on_the_post(
    client: httpx.Client, extra: dict[str, Any], param: str, code: str, stream: bool
) -> None:
    """Refused with the plain request's error before anything is queued, not `queued` and `failed` later."""
    plain = assert_error(client.post("/v1/responses", json=GREEDY | extra), 400)
    refused = client.post("/v1/responses", json=GREEDY | extra | {"background": True, "stream": stream})
    assert assert_error(refused, 400) == plain
    assert (plain["param"], plain["code"]) == (param, code)


def test_a_prompt_that_does_not_fit_the_engine_is_a_400_on_the_post(client: httpx.Client) -> None:
    plain = assert_error(client.post("/v1/responses", json=GREEDY | {"input": TOO_LONG}), 400)
    body = GREEDY | {"input": TOO_LONG, "background": True}
    assert assert_error(client.post("/v1/responses", json=body), 400) == plain
    assert "KV cache" in plain["message"] and plain["code"] == "invalid_request"


def test_a_failing_background_response_is_failed_with_its_error(
    client: httpx.Client, engine: AsyncEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What the engine refuses once the request runs fails the queued response."""

    monkeypatch.setattr(engine, "generate", refused_generate)
    rid = background(client, **GREEDY)["id"]
    failed = poll(client, rid)
    monkeypatch.undo()
    assert failed["status"] == "failed" and failed["output"] == [] and failed["usage"] is None
    message = failed["error"]["message"]
    assert failed["error"]["code"] == "invalid_prompt" and "the engine refused it" in message, message
    assert message.endswith("(invalid_request)")
    assert_error(client.post(f"/v1/responses/{rid}/cancel"), 400, "Cannot cancel a failed")


def test_delete_cancels_a_running_response(client: httpx.Client, engine: AsyncEngine) -> None:
    wait_idle(engine)  # earlier tests' aborts have all landed
    aborted = engine.engine.stats().num_requests_aborted
    rid = background(client, **LONG)["id"]
    reaches_the_engine(engine)
    deleted = client.delete(f"/v1/responses/{rid}")
    assert deleted.status_code == 200 and deleted.json()["deleted"] is True
    wait_idle(engine, timeout=5)
    assert engine.engine.stats().num_requests_aborted == aborted + 1
    assert_error(client.get(f"/v1/responses/{rid}"), 404, "not found")


def test_a_running_response_is_not_evicted_and_shutdown_cancels_it(engine: AsyncEngine) -> None:
    limits = ServerLimits(responses_store_size=1, shutdown_timeout_s=60)
    small = build_app(engine, engine.engine.tokenizer, model_name="tiny", api_key=KEY, limits=limits)
    wait_idle(engine)
    aborted = engine.engine.stats().num_requests_aborted
    started = time.monotonic()
    with serve(small) as base, httpx.Client(base_url=base, headers=AUTH, timeout=30) as client:
        rid = background(client, **LONG)["id"]
        reaches_the_engine(engine)
        first, second = post(client, **GREEDY), post(client, **GREEDY)
        assert client.get(f"/v1/responses/{rid}").json()["status"] in ("queued", "in_progress")
        assert_error(client.get(f"/v1/responses/{first['id']}"), 404)  # evicted in its place
        assert client.get(f"/v1/responses/{second['id']}").status_code == 200
    # Shutdown cancelled it at once (not after its 60 s drain timeout), and its engine request with it.
    wait_idle(engine, timeout=5)
    assert time.monotonic() - started < 30
    assert engine.engine.stats().num_requests_aborted == aborted + 1


def test_a_closing_event_loop_cancels_a_running_response_safely(app: Any, engine: AsyncEngine) -> None:
    """`asyncio.run` cancels the tasks left when it ends (an ASGI call per loop, as other tests make): the
    cancelled background response's abort may reach the step thread after its loop has closed, which the engine
    must survive (`AsyncEngine`: a closed loop's requests are aborted, the step loop goes on)."""

    async def main() -> dict[str, Any]:
        transport = httpx.ASGITransport(app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test", headers=AUTH) as client:
            queued = (await client.post("/v1/responses", json=LONG | {"background": True})).json()
            deadline = time.monotonic() + 30
            while not engine.engine.has_unfinished():  # decoding before the loop ends
                assert time.monotonic() < deadline, "the background response never reached the engine"
                await asyncio.sleep(0.01)
            return queued

    wait_idle(engine)
    aborted = engine.engine.stats().num_requests_aborted
    for _ in range(3):
        assert asyncio.run(main())["status"] == "queued"
        wait_idle(engine, timeout=5)
    assert engine.engine.stats().num_requests_aborted == aborted + 3
    plain = call(app, "POST", "/v1/responses", json=GREEDY)
    assert plain.status_code == 200 and engine.is_running, plain.text


def test_the_openai_sdk_creates_retrieves_and_cancels(url: str, engine: AsyncEngine) -> None:
    sdk = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)
    created = sdk.responses.create(**GREEDY, background=True)
    assert created.status == "queued" and created.background is True
    deadline = time.monotonic() + 60
    response = sdk.responses.retrieve(created.id)
    while response.status in ("queued", "in_progress"):
        assert time.monotonic() < deadline
        time.sleep(0.05)
        response = sdk.responses.retrieve(created.id)
    assert response.status in ("completed", "incomplete") and response.output_text and response.usage, (
        response.error
    )
    running = sdk.responses.create(
        model="tiny", input="Count.", max_output_tokens=1500, background=True, extra_body={"ignore_eos": True}
    )
    assert sdk.responses.cancel(running.id).status == "cancelled"
    wait_idle(engine, timeout=5)
