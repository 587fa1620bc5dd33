"""OpenAI batch files: the request lines `structgen run-batch` reads and the result lines it writes.

A request line is `{"custom_id", "method": "POST", "url", "body"}`. A result line is OpenAI's batch output:
`{"id": "batch_req_<hex>", "custom_id", "response": {"status_code", "request_id", "body"}, "error": null}` for
every request the server answered (a 4xx / 5xx keeps its status and OpenAI error body, as OpenAI's own batch
output does), and `"response": null, "error": {"code", "message"}` for a line that never became a request
(not JSON, a field missing or of the wrong type, an unknown url, a stream).
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

# Every generation route of the app; a line is sent to the app under its own url, so each works as soon as the
# app serves it.
BATCH_URLS = ("/v1/chat/completions", "/v1/completions", "/v1/responses")


@dataclass(slots=True, frozen=True, kw_only=True)
class BatchRequest:
    custom_id: str
    url: str
    body: dict[str, Any]


@dataclass(slots=True, frozen=True, kw_only=True)
class LineError:
    """Why a line is not a request; `custom_id` when the line has a usable one."""

    custom_id: str | None
    code: str
    message: str


@dataclass(slots=True, frozen=True, kw_only=True)
class BatchResult:
    """One result line, and what the summary counts of it."""

    record: dict[str, Any]
    ok: bool
    output_tokens: int = 0


def parse_line(line: str, seen_ids: set[str]) -> BatchRequest | LineError:
    """The request on `line`, or why it is none. `seen_ids` (the custom ids of the lines before) is updated: a
    custom id must be unique, as OpenAI requires, since it is all that ties a result to its request."""
    try:
        data = json.loads(line)
    except json.JSONDecodeError as error:
        return LineError(custom_id=None, code="invalid_json_line", message=f"the line is not JSON: {error}")
    if not isinstance(data, dict):
        return LineError(custom_id=None, code="invalid_json_line", message="the line must be a JSON object")
    custom_id = data.get("custom_id")
    if "custom_id" not in data:
        return LineError(custom_id=None, code="missing_required_parameter", message="custom_id is missing")
    if not isinstance(custom_id, str) or not custom_id:
        return LineError(
            custom_id=None, code="invalid_custom_id", message="custom_id must be a non-empty string"
        )
    if custom_id in seen_ids:
        return LineError(
            custom_id=custom_id,
            code="duplicate_custom_id",
            message=f"custom_id {custom_id!r} is used by an earlier line",
        )
    seen_ids.add(custom_id)
    problem = _request_problem(data)
    if problem is not None:
        return LineError(custom_id=custom_id, code=problem[0], message=problem[1])
    return BatchRequest(custom_id=custom_id, url=data["url"], body=data["body"])


def _request_problem(data: dict[str, Any]) -> tuple[str, str] | None:
    """(code, message) for a line whose method, url or body cannot be sent."""
    for key in ("method", "url", "body"):
        if key not in data:
            return "missing_required_parameter", f"{key} is missing"
    if data["method"] != "POST":
        return "invalid_method", f"method must be 'POST', got {data['method']!r}"
    if data["url"] not in BATCH_URLS:
        return "invalid_url", f"url must be one of {', '.join(BATCH_URLS)}; got {data['url']!r}"
    if not isinstance(data["body"], dict):
        return "invalid_body", "body must be a JSON object (the request's body)"
    if data["body"].get("stream") is True:
        return "stream_not_supported", "a batch request cannot stream: drop 'stream' from its body"
    return None


def response_result(custom_id: str, status: int, body: Any) -> BatchResult:
    """The result of a request the app answered with `status` and `body`."""
    request_id = body.get("id") if isinstance(body, dict) else None
    record = {
        "id": _new_id("batch_req"),
        "custom_id": custom_id,
        "response": {
            "status_code": status,
            # The answer's own id (chatcmpl-..., cmpl-..., resp_...); an error body has none.
            "request_id": request_id if isinstance(request_id, str) else _new_id("req"),
            "body": body,
        },
        "error": None,
    }
    return BatchResult(record=record, ok=200 <= status < 300, output_tokens=_output_tokens(body))


def error_result(error: LineError) -> BatchResult:
    record = {
        "id": _new_id("batch_req"),
        "custom_id": error.custom_id,
        "response": None,
        "error": {"code": error.code, "message": error.message},
    }
    return BatchResult(record=record, ok=False)


def _output_tokens(body: Any) -> int:
    """The generated tokens of an answer: chat and completions say `completion_tokens`, responses
    `output_tokens`."""
    usage = body.get("usage") if isinstance(body, dict) else None
    if not isinstance(usage, dict):
        return 0
    tokens = usage.get("completion_tokens", usage.get("output_tokens"))
    return tokens if isinstance(tokens, int) else 0


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"
