"""Draft-model speculation behind the server on `tiny` (the target drafting for itself): a JSON-schema chat answer
is the one the server gives without speculation, and `/metrics` shows the proposed and accepted tokens and the
acceptance rate under the method's label."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from server_helpers import KEY, USER, call

from structgen.config import CacheConfig, EngineConfig
from structgen.engine.async_engine import AsyncEngine
from structgen.server import build_app

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 20}, "count": {"type": "integer"}},
    "required": ["name", "count"],
    "additionalProperties": False,
}
BODY = {
    "model": "tiny",
    "messages": USER,
    "temperature": 0,
    "max_tokens": 40,
    "response_format": {"type": "json_schema", "json_schema": {"name": "thing", "schema": SCHEMA}},
}


def _app(speculative: dict[str, Any] | None) -> tuple[Any, AsyncEngine]:
    config = EngineConfig(
        model="tiny",
        device="cpu",
        dtype="float32",
        cache=CacheConfig(kv_cache_tokens=2048),
        speculative_config=speculative,
    )
    engine = AsyncEngine.from_config(config)
    return build_app(engine, engine.engine.tokenizer, model_name="tiny", api_key=KEY), engine


@pytest.fixture(scope="module")
def apps() -> Iterator[dict[str, Any]]:
    made = {
        "off": _app(None),
        "draft": _app({"model": "tiny", "num_speculative_tokens": 4}),
    }
    yield {name: app for name, (app, _) in made.items()}
    for _, engine in made.values():
        engine.shutdown()


def test_the_answer_is_the_one_without_speculation_and_metrics_show_it(apps: dict[str, Any]) -> None:
    answers = {}
    for name, app in apps.items():
        response = call(app, "POST", "/v1/chat/completions", json=BODY)
        assert response.status_code == 200, response.text
        answers[name] = response.json()["choices"][0]["message"]["content"]
    assert answers["draft"] == answers["off"]
    text = call(apps["draft"], "GET", "/metrics").text
    lines = dict(line.rsplit(" ", 1) for line in text.splitlines() if line and not line.startswith("#"))
    proposed = float(lines['structgen_spec_decode_num_draft_tokens_total{method="draft_model"}'])
    accepted = float(lines['structgen_spec_decode_num_accepted_tokens_total{method="draft_model"}'])
    assert proposed > 0 and 0 < accepted <= proposed
    rate = float(lines['structgen_spec_decode_acceptance_rate{method="draft_model"}'])
    assert rate == pytest.approx(accepted / proposed)
    plain = call(apps["off"], "GET", "/metrics").text
    assert "structgen_spec_decode" not in plain
