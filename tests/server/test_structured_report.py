"""The `structured` report of each choice over HTTP, on `tiny`: on plain choices of structured requests (null for
unconstrained ones), on the chunk that finishes a streamed choice only, on tool calls; the closing and loop
counts in it and in `/metrics`; the per-request switches reaching the engine; the `openai` SDK reading it all."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any, Literal

import openai
import pytest
from live_server import serve, wait_idle
from prometheus_client.parser import text_string_to_metric_families
from pydantic import BaseModel, ConfigDict
from server_helpers import USER, assert_error, call, sse_events

from structgen.engine.async_engine import AsyncEngine
from structgen.engine.outputs import CompletionOutput, RequestOutput
from structgen.sampling_params import SamplingParams
from structgen.server import build_app

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
REPORT_KEYS = {"backend", "path", "valid", "retries", "closed_at_budget", "loops_ended", "forced_tokens"}
SCHEMA = {
    "type": "object",
    "properties": {"n": {"type": "integer"}},
    "required": ["n"],
    "additionalProperties": False,
}
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "num", "schema": SCHEMA}}
TOOL = {
    "type": "function",
    "function": {
        "name": "pick",
        "parameters": {
            "type": "object",
            "properties": {"color": {"enum": ["red", "green"]}},
            "required": ["color"],
            "additionalProperties": False,
        },
    },
}


@pytest.fixture
def app(engine: AsyncEngine) -> Any:
    """A fresh app (and metrics registry) per test."""
    return build_app(engine, engine.engine.tokenizer, model_name="tiny")


def spy_on(
    engine: AsyncEngine,
    monkeypatch: pytest.MonkeyPatch,
    mark: Callable[[CompletionOutput], None] | None = None,
) -> list[SamplingParams]:
    """Record the params of every engine request; `mark` edits each finished structured output on its way out
    (as the engine would report a closing or an ended loop)."""
    seen: list[SamplingParams] = []
    original = engine.generate

    def generate(prompt: Any, params: SamplingParams, **kwargs: Any) -> AsyncIterator[RequestOutput]:
        seen.append(params)
        outputs = original(prompt, params, **kwargs)

        async def marked() -> AsyncIterator[RequestOutput]:
            try:
                async for output in outputs:
                    for o in output.outputs:
                        if mark is not None and o.finished and o.structured is not None:
                            mark(o)
                    yield output
            finally:
                await outputs.aclose()  # type: ignore[attr-defined]

        return marked()

    monkeypatch.setattr(engine, "generate", generate)
    return seen


def check_report(report: Any) -> None:
    assert isinstance(report, dict) and set(report) == REPORT_KEYS, report
    assert isinstance(report["backend"], str) and report["path"] in (
        "exact",
        "rewritten",
        "restricted",
        "relaxed",
    )
    assert isinstance(report["valid"], bool) and isinstance(report["retries"], int)
    assert isinstance(report["closed_at_budget"], bool) and isinstance(report["loops_ended"], int)
    assert isinstance(report["forced_tokens"], int) and report["forced_tokens"] >= 0


def test_plain_choices_carry_the_report_and_unconstrained_ones_null(app: Any, engine: AsyncEngine) -> None:
    shaped = call(
        app, "POST", CHAT, json={"messages": USER, "max_tokens": 12, "response_format": RESPONSE_FORMAT}
    )
    choice = shaped.json()["choices"][0]
    check_report(choice["structured"])
    # Cut by max_tokens (random weights may not finish) means not valid; finished means valid.
    assert choice["structured"]["valid"] is (choice["finish_reason"] == "stop")
    regex = call(
        app, "POST", COMPLETIONS, json={"prompt": "id:", "max_tokens": 8, "guided_regex": "[ab]{3}", "n": 2}
    )
    for choice in regex.json()["choices"]:
        check_report(choice["structured"])
        assert choice["structured"]["valid"] is True and choice["finish_reason"] == "stop"
    for path, body in ((CHAT, {"messages": USER}), (COMPLETIONS, {"prompt": "Hi"})):
        plain = call(app, "POST", path, json=body | {"max_tokens": 2}).json()
        assert "structured" in plain["choices"][0] and plain["choices"][0]["structured"] is None
    wait_idle(engine)


def _finish_chunks(events: list[Any]) -> tuple[dict[int, Any], int]:
    """The `structured` of each choice's finishing chunk, and how many other chunks carry the key at all."""
    reports, elsewhere = {}, 0
    for event in events:
        for choice in event["choices"]:
            if choice.get("finish_reason") is not None:
                reports[choice["index"]] = choice.get("structured")
            elif "structured" in choice:
                elsewhere += 1
    return reports, elsewhere


def test_streams_send_the_report_on_the_finishing_chunk_only(app: Any, engine: AsyncEngine) -> None:
    cases = [
        (CHAT, {"messages": USER, "max_tokens": 10, "guided_choice": ["yes", "no"], "n": 2}),
        (COMPLETIONS, {"prompt": "id:", "max_tokens": 8, "guided_regex": "[ab]{3}"}),
        (CHAT, {"messages": USER, "max_tokens": 12, "response_format": RESPONSE_FORMAT}),
    ]
    for path, body in cases:
        body = body | {"temperature": 0}
        plain = call(app, "POST", path, json=body).json()
        reports, elsewhere = _finish_chunks(sse_events(call(app, "POST", path, json=body | {"stream": True})))
        assert elsewhere == 0
        assert reports == {c["index"]: c["structured"] for c in plain["choices"]}, path
        for report in reports.values():
            check_report(report)
    unconstrained = sse_events(
        call(app, "POST", CHAT, json={"messages": USER, "max_tokens": 3, "stream": True})
    )
    assert _finish_chunks(unconstrained) == ({0: None}, 0)
    wait_idle(engine)


def test_tool_calls_get_the_report_plain_and_streamed(app: Any, engine: AsyncEngine) -> None:
    body = {"messages": USER, "max_tokens": 30, "tools": [TOOL], "tool_choice": "required", "temperature": 0}
    choice = call(app, "POST", CHAT, json=body).json()["choices"][0]
    check_report(choice["structured"])
    reports, elsewhere = _finish_chunks(sse_events(call(app, "POST", CHAT, json=body | {"stream": True})))
    assert elsewhere == 0 and reports == {0: choice["structured"]}
    wait_idle(engine)


def _counters(app: Any) -> dict[str, float]:
    text = call(app, "GET", "/metrics").text
    return {s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples}


def test_closings_and_ended_loops_show_in_the_report_and_the_metrics(
    app: Any, engine: AsyncEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    before = _counters(app)
    assert before["structgen_structured_closed_at_budget_total"] == 0
    assert before["structgen_structured_loops_ended_total"] == 0

    def closed_with_two_loops(output: CompletionOutput) -> None:
        assert output.structured is not None
        output.structured.closed_at_budget = True
        output.structured.loops_ended = 2

    spy_on(engine, monkeypatch, closed_with_two_loops)
    body = {"messages": USER, "max_tokens": 12, "response_format": RESPONSE_FORMAT, "n": 2}
    for choice in call(app, "POST", CHAT, json=body).json()["choices"]:
        assert choice["structured"]["closed_at_budget"] is True and choice["structured"]["loops_ended"] == 2
    events = sse_events(call(app, "POST", CHAT, json=body | {"n": 1, "stream": True}))
    assert _finish_chunks(events)[0][0]["closed_at_budget"] is True
    call(app, "POST", CHAT, json={"messages": USER, "max_tokens": 2})  # unconstrained: counts nothing
    after = _counters(app)
    assert after["structgen_structured_closed_at_budget_total"] == 3
    assert after["structgen_structured_loops_ended_total"] == 6
    wait_idle(engine)


def test_the_switches_reach_the_engine(
    app: Any, engine: AsyncEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen = spy_on(engine, monkeypatch)
    off = {"close_at_budget": False, "loop_guard": False}
    bodies = [
        {"response_format": RESPONSE_FORMAT, "structured_outputs": off},
        {"structured_outputs": {"json": SCHEMA, **off}},
        {"guided_choice": ["a", "b"], "structured_outputs": off},
        {"tools": [TOOL], "tool_choice": "required", "structured_outputs": off},
    ]
    for body in bodies:
        response = call(app, "POST", CHAT, json={"messages": USER, "max_tokens": 4} | body)
        assert response.status_code == 200, response.text
        structured = seen[-1].structured_outputs
        assert structured is not None and (structured.close_at_budget, structured.loop_guard) == (
            False,
            False,
        )
    assert len(seen) == len(bodies)
    bad = {
        "messages": USER,
        "response_format": RESPONSE_FORMAT,
        "structured_outputs": {"close_at_budget": "no"},
    }
    error = assert_error(call(app, "POST", CHAT, json=bad), 400, "close_at_budget")
    assert error["param"] == "structured_outputs.close_at_budget"
    lonely = assert_error(call(app, "POST", CHAT, json={"messages": USER, "structured_outputs": off}), 400)
    assert lonely["param"] == "structured_outputs" and len(seen) == len(bodies)
    wait_idle(engine)


# -- the official SDK -------------------------------------------------------------------------------------------


class Pick(BaseModel):
    model_config = ConfigDict(extra="forbid")  # additionalProperties: false, so the object ends after it

    color: Literal["red", "green"]


@pytest.fixture
def client(app: Any) -> Iterator[openai.OpenAI]:
    with serve(app) as url:
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


def test_the_openai_sdk_parses_responses_with_the_report(client: openai.OpenAI, engine: AsyncEngine) -> None:
    ask = [{"role": "user", "content": "Pick a color."}]
    parsed = client.chat.completions.parse(
        model="tiny", messages=ask, response_format=Pick, max_tokens=20, temperature=0
    )
    choice = parsed.choices[0]
    assert isinstance(choice.message.parsed, Pick) and choice.finish_reason == "stop"
    report = (choice.model_extra or {})["structured"]
    check_report(report)
    assert report["valid"] is True
    chunks = list(
        client.chat.completions.create(
            model="tiny",
            messages=ask,
            max_tokens=10,
            stream=True,
            extra_body={"guided_choice": ["red", "green"]},
        )
    )
    last = chunks[-1].choices[0]
    assert last.finish_reason == "stop" and (last.model_extra or {})["structured"]["valid"] is True
    assert all("structured" not in (c.choices[0].model_extra or {}) for c in chunks[:-1])
    plain = client.chat.completions.create(model="tiny", messages=ask, max_tokens=2)
    assert (plain.choices[0].model_extra or {}).get("structured") is None
    wait_idle(engine)


def test_a_real_closing_over_http(app: Any, engine: AsyncEngine) -> None:
    """No spy: `tiny` (random weights) never closes its JSON on its own, so a small budget makes the engine
    close it. The choice finishes "stop" with valid JSON, says so, and the counter moves; switched off per
    request, the same call is cut ("length") as before."""
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string"}, "tags": {"type": "array", "items": {"type": "string"}}},
        "required": ["name", "tags"],
    }
    response_format = {"type": "json_schema", "json_schema": {"name": "t", "schema": schema}}
    body = {"messages": USER, "max_tokens": 24, "response_format": response_format, "temperature": 0}
    choice = call(app, "POST", CHAT, json=body).json()["choices"][0]
    assert choice["finish_reason"] == "stop"
    assert choice["structured"]["closed_at_budget"] is True and choice["structured"]["valid"] is True
    assert set(json.loads(choice["message"]["content"])) == {"name", "tags"}
    assert _counters(app)["structgen_structured_closed_at_budget_total"] == 1
    off = body | {"structured_outputs": {"close_at_budget": False, "loop_guard": False}}
    choice = call(app, "POST", CHAT, json=off).json()["choices"][0]
    assert choice["finish_reason"] == "length" and choice["structured"]["closed_at_budget"] is False
    wait_idle(engine)
