"""Schemathesis against the server's own OpenAPI document (issue 10, item 2), on `tiny`: a fixed, small number
of generated requests per operation (valid and invalid bodies), with `max_tokens` (and `n`, `min_tokens`)
clamped so that each finishes in a few decode steps. Checks: no 5xx, every 4xx carries the OpenAI error body,
status codes, content types and JSON bodies conform to the document."""

from __future__ import annotations

from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from reliability_helpers import AUTH, assert_error_body, keyed_app

from structgen.engine.async_engine import AsyncEngine

EXAMPLES_PER_OPERATION = 25
CALL_TIMEOUT_S = 30.0
# Generation fields whose value sets the work a request costs: big ones are clamped to these.
CLAMPED = {
    "max_tokens": 3,
    "max_completion_tokens": 3,
    "max_output_tokens": 3,
    "n": 2,
    "min_tokens": 2,
    "top_logprobs": 3,
}
_CAPS = ("max_tokens", "max_completion_tokens", "max_output_tokens")


@pytest.fixture
def fuzz_app(server_tiny_engine: AsyncEngine) -> Any:
    """A fresh app per test: schemathesis' pytest plugin ends the ASGI lifespans it started after each test,
    which drains the app for good."""
    return keyed_app(server_tiny_engine)


@pytest.fixture
def api_schema(fuzz_app: Any) -> Any:
    # Loaded over ASGI with the key: the document is behind it like every route but `/health`.
    return schemathesis.openapi.from_asgi("/openapi.json", fuzz_app, headers=AUTH)


def openai_error_shape(ctx: Any, response: Any, case: Any) -> None:
    """Every error status carries OpenAI's error body (and never a traceback)."""
    if response.status_code >= 400:
        assert_error_body(response.json())


def _clamp(body: Any) -> None:
    if not isinstance(body, dict):
        return
    for name, most in CLAMPED.items():
        value = body.get(name)
        if isinstance(value, int) and not isinstance(value, bool) and value > most:
            body[name] = most
    if all(body.get(cap) is None for cap in _CAPS):
        # Absent or null means the server's default cap (4,096 tokens): too slow here. Chat and completions read
        # `max_tokens`, the Responses API `max_output_tokens`; each ignores the other's.
        body["max_tokens"] = body["max_output_tokens"] = CLAMPED["max_tokens"]


def _check(case: Any) -> None:
    _clamp(case.body)
    case.call_and_validate(
        headers=AUTH,
        timeout=CALL_TIMEOUT_S,
        checks=[
            schemathesis.checks.not_a_server_error,
            schemathesis.checks.status_code_conformance,
            schemathesis.checks.content_type_conformance,
            schemathesis.checks.response_schema_conformance,
        ],
        additional_checks=[openai_error_shape],
    )


# Schemathesis' own pytest integration does not run under pytest 9, so each operation's cases are drawn with
# hypothesis directly; every operation runs, and the failures of all are reported together.
@pytest.mark.parametrize("mode", [schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE])
def test_the_server_keeps_to_its_openapi_document(api_schema: Any, mode: Any) -> None:
    operations = [result.ok() for result in api_schema.get_all_operations()]
    assert {op.label for op in operations} >= {"POST /v1/chat/completions", "POST /v1/completions"}
    failures = {}
    sent: dict[str, int] = {}
    for operation in operations:
        if mode.is_negative and not operation.body:
            continue  # no parameters, no body: nothing can be invalid

        @given(case=operation.as_strategy(generation_mode=mode))
        @settings(
            max_examples=EXAMPLES_PER_OPERATION,
            deadline=None,
            derandomize=True,
            database=None,
            phases=[Phase.explicit, Phase.generate],  # a failure is reported as drawn: shrinking is slow
            suppress_health_check=list(HealthCheck),
        )
        def run(case: Any) -> None:
            sent[case.operation.label] = sent.get(case.operation.label, 0) + 1
            _check(case)

        try:
            run()
        except Exception as error:
            failures[operation.label] = error
    assert not failures, "\n\n".join(f"{label}: {error}" for label, error in failures.items())
    print(f"{mode} requests sent per operation: {sent}")
    assert sent["POST /v1/chat/completions"] >= 5 and sent["POST /v1/completions"] >= 5, sent


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "stream": True}),
        ("/v1/completions", {"prompt": "hi", "stream": True, "stream_options": {"include_usage": True}}),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "hi"}], "guided_choice": ["a", "b"]},
        ),
    ],
    ids=["chat-stream", "completion-stream", "chat-choice"],
)
def test_real_responses_conform_to_the_document(api_schema: Any, path: str, body: dict[str, Any]) -> None:
    """Not left to chance: a streamed answer's SSE events and a plain answer validate against the document."""
    case = api_schema[path]["POST"].Case(body=body | {"max_tokens": 3})
    case.call_and_validate(
        headers=AUTH,
        timeout=CALL_TIMEOUT_S,
        checks=[
            schemathesis.checks.response_schema_conformance,
            schemathesis.checks.content_type_conformance,
        ],
    )
