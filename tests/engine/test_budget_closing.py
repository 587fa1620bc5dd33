"""Structured outputs that always finish, through the engine on `tiny` (random weights: it rarely closes JSON on
its own, so nearly every output meets its budget): budget-aware closing and the loop guard."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest
from engine_helpers import EngineFactory, run_all

from structgen.sampling_params import SamplingParams
from structgen.structured import StructuredOutputsParams
from structgen.tools import ToolCallPlan, parse_tool_calls, parse_tools

SCHEMAS: dict[str, dict[str, Any]] = {
    "nested": {
        "type": "object",
        "properties": {
            "person": {
                "type": "object",
                "properties": {"name": {"type": "string"}, "age": {"type": "integer", "minimum": 0}},
                "required": ["name", "age"],
                "additionalProperties": False,
            },
            "city": {"type": "string"},
        },
        "required": ["person", "city"],
        "additionalProperties": False,
    },
    "arrays": {
        "type": "object",
        "properties": {
            "attendees": {"type": "array", "items": {"type": "string"}, "minItems": 1},
            "scores": {"type": "array", "items": {"type": "number"}},
        },
        "required": ["attendees", "scores"],
    },
    "enums_patterns": {
        "type": "object",
        "properties": {
            "status": {"enum": ["open", "closed", "pending review"]},
            "code": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{3}$"},
            "when": {"type": "string", "format": "date"},
            "note": {"type": "string", "maxLength": 40},
        },
        "required": ["status", "code", "when", "note"],
        "additionalProperties": False,
    },
}
WEATHER = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
                "required": ["city", "unit"],
            },
        },
    }
]


def _params(max_tokens: int, seed: int, **structured: Any) -> SamplingParams:
    return SamplingParams(
        temperature=1.0,
        seed=seed,
        max_tokens=max_tokens,
        structured_outputs=StructuredOutputsParams(**structured),
    )


def _run(make_engine: EngineFactory, requests: dict[str, SamplingParams], *, stream: bool) -> dict[str, Any]:
    engine = make_engine()
    for request_id, params in requests.items():
        # The same prompt for the same seed whatever the switches (the id's first part names them).
        engine.add_request(
            request_id, f"Answer {request_id.split('-', 1)[-1]} as JSON:", params, stream=stream
        )
    return {rid: out.outputs[0] for rid, out in run_all(engine).items()}


@pytest.mark.parametrize("name", list(SCHEMAS))
def test_closing_finishes_every_output_and_says_so(make_engine: EngineFactory, name: str) -> None:
    schema = SCHEMAS[name]
    budgets = [24, 31, 45]
    requests = {
        f"{close}-{budget}-{seed}": _params(
            budget, seed, json=schema, close_at_budget=close, loop_guard=False
        )
        for close in (True, False)
        for budget in budgets
        for seed in range(3)
    }
    outs = _run(make_engine, requests, stream=name == "arrays")
    for budget in budgets:
        for seed in range(3):
            closed, plain = outs[f"True-{budget}-{seed}"], outs[f"False-{budget}-{seed}"]
            assert closed.finish_reason == "stop", closed.text
            assert len(closed.token_ids) <= budget
            jsonschema.validate(json.loads(closed.text), schema, format_checker=jsonschema.FormatChecker())
            assert closed.structured.valid is True
            # Closed exactly when the output would have been cut; untouched otherwise.
            assert closed.structured.closed_at_budget == (plain.finish_reason == "length")
            if plain.finish_reason == "stop":
                assert closed.text == plain.text
            else:
                assert plain.structured.valid is not True and not plain.structured.closed_at_budget


def test_a_budget_below_the_shortest_completion_truncates_as_before(make_engine: EngineFactory) -> None:
    schema = SCHEMAS["enums_patterns"]  # its shortest output is ~25 tokens
    outs = _run(make_engine, {"short": _params(6, 0, json=schema)}, stream=False)
    out = outs["short"]
    assert out.finish_reason == "length"
    assert not out.structured.closed_at_budget and out.structured.valid is not True


def test_closing_can_be_switched_off_per_request_and_on_for_a_regex(make_engine: EngineFactory) -> None:
    schema = SCHEMAS["nested"]
    requests = {
        "off": _params(20, 1, json=schema, close_at_budget=False),
        "regex-default": _params(6, 1, regex="[a-z]{3,400}"),
        "regex-on": _params(6, 1, regex="[a-z]{3,400}", close_at_budget=True),
    }
    outs = _run(make_engine, requests, stream=False)
    assert outs["off"].finish_reason == "length" and not outs["off"].structured.closed_at_budget
    assert outs["regex-default"].finish_reason == "length"  # off by default for regexes
    assert outs["regex-on"].finish_reason == "stop" and outs["regex-on"].structured.closed_at_budget


def test_tool_calls_close_within_the_budget(make_engine: EngineFactory) -> None:
    plan = ToolCallPlan.build(WEATHER, "required")
    tools = parse_tools(WEATHER)
    structured = plan.structured_outputs()
    assert structured is not None
    requests = {
        f"tool-{seed}": SamplingParams(
            temperature=1.0, seed=seed, max_tokens=40, structured_outputs=structured
        )
        for seed in range(4)
    }
    for out in _run(make_engine, requests, stream=True).values():
        assert out.finish_reason == "stop", out.text
        parsed = parse_tool_calls(out.text, plan.format, tools)
        assert parsed.valid and parsed.calls, out.text
        assert all(set(call.parsed_arguments()) >= {"city", "unit"} for call in parsed.calls)


def test_loop_guard_leaves_outputs_without_loops_unchanged(make_engine: EngineFactory) -> None:
    schema = SCHEMAS["arrays"]
    requests = {
        f"{guard}-{seed}": _params(120, seed, json=schema, loop_guard=guard, close_at_budget=True)
        for guard in (True, False)
        for seed in range(6)
    }
    outs = _run(make_engine, requests, stream=False)
    guarded = 0
    for seed in range(6):
        on, off = outs[f"True-{seed}"], outs[f"False-{seed}"]
        assert on.finish_reason == "stop"
        jsonschema.validate(json.loads(on.text), schema)
        if on.structured.loops_ended == 0:
            assert on.text == off.text
        else:
            guarded += 1
    assert off.structured.loops_ended == 0


def test_a_relaxed_schema_never_returns_a_closed_output_that_fails_it(make_engine: EngineFactory) -> None:
    """`not` is served relaxed and validated afterwards: where the shortest completion of the relaxed grammar
    misses the schema, the output counts as cut ("length", invalid), never as a finished invalid output."""
    schema = {
        "type": "object",
        "properties": {"tags": {"type": "array", "items": {"type": "string"}}},
        "required": ["tags"],
        "not": {"properties": {"tags": {"maxItems": 0}}},
    }
    requests = {
        f"r-{budget}-{seed}": _params(budget, seed, json=schema) for budget in (4, 9, 16) for seed in range(3)
    }
    outs = _run(make_engine, requests, stream=False)
    for out in outs.values():
        assert out.structured.path == "relaxed"
        if out.finish_reason == "stop":
            assert out.structured.valid is True
            jsonschema.validate(json.loads(out.text), schema)
        else:
            assert out.finish_reason == "length"
            assert out.structured.valid is not True and not out.structured.closed_at_budget
