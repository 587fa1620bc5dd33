"""The schema errors of issue 5 on `tiny`: a schema that is not valid JSON Schema, and a compile that outlives
the engine's time limit, each a 400 in OpenAI's shape (plain and streamed)."""

from __future__ import annotations

import json
from concurrent.futures import Future

from server_helpers import USER, assert_error, call, tiny_engine

from structgen.engine.async_engine import AsyncEngine
from structgen.server import build_app
from structgen.structured import StructuredOutputConfig


def _json_schema(schema: dict[str, object]) -> dict[str, object]:
    return {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}


def test_a_schema_that_is_not_json_schema_is_a_400(engine: AsyncEngine) -> None:
    app = build_app(engine, engine.engine.tokenizer, model_name="tiny")
    bad = {"type": "object", "properties": {"a": {"type": "strng"}}}
    for stream in (False, True):
        body = {"messages": USER, "max_tokens": 3, "response_format": _json_schema(bad), "stream": stream}
        error = assert_error(call(app, "POST", "/v1/chat/completions", json=body, headers=None), 400, "strng")
        assert error["param"] == "response_format"


def test_a_compile_over_the_time_limit_is_a_400() -> None:
    slow = tiny_engine(structured=StructuredOutputConfig(compile_timeout_s=0.0005))
    try:
        app = build_app(slow, slow.engine.tokenizer, model_name="tiny")
        schema = {
            "type": "object",
            "properties": {f"field_{i}": {"type": "array", "items": {"type": "string"}} for i in range(40)},
        }
        body = {"messages": USER, "max_tokens": 3, "response_format": _json_schema(schema)}
        error = assert_error(call(app, "POST", "/v1/chat/completions", json=body, headers=None), 400, "limit")
        assert error["code"] == "compile_timeout"
        plain = call(app, "POST", "/v1/completions", json={"prompt": "ok", "max_tokens": 2}, headers=None)
        assert plain.status_code == 200 and json.loads(plain.text)["choices"][0]["text"] is not None
    finally:
        slow.shutdown()


def test_compiles_stuck_past_their_limit_make_new_ones_a_503(engine: AsyncEngine, monkeypatch) -> None:
    """Not the request's fault: 503 with Retry-After, so clients back off instead of giving up."""
    app = build_app(engine, engine.engine.tokenizer, model_name="tiny")
    manager = engine.engine.structured.ensure_manager()
    stuck = {Future() for _ in range(manager.config.max_abandoned_compiles + 1)}  # never finishing compiles
    monkeypatch.setattr(manager, "_abandoned", stuck)
    body = {"messages": USER, "max_tokens": 3, "response_format": _json_schema({"type": "array"})}
    response = call(app, "POST", "/v1/chat/completions", json=body, headers=None)
    error = assert_error(response, 503, "try again later")
    assert error["code"] == "compile_busy" and response.headers["retry-after"] == "5"
