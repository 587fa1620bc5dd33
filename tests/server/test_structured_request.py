"""The structured-output fields of a request (`structgen.server.structured_request`): one constraint from
`response_format`, `guided_*` or `structured_outputs`, and a `structured_outputs` holding only options
(`close_at_budget`, `loop_guard`, `whitespace`, `max_whitespace`, `strict`) applied to whichever constraint the
request names, tools included."""

from __future__ import annotations

from typing import Any

import pytest

from structgen.server.errors import APIError
from structgen.server.structured_request import resolve_structured, structured_options
from structgen.structured import StructuredOutputsParams
from structgen.tools import ToolCallPlan

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA, "strict": True}}
NO_GUIDED: dict[str, Any] = {"guided_json": None, "guided_regex": None, "guided_choice": None}


def resolve(
    *,
    response_format: dict[str, Any] | None = None,
    guided: dict[str, Any] | None = None,
    structured_outputs: dict[str, Any] | None = None,
    has_tools: bool = False,
) -> StructuredOutputsParams | None:
    return resolve_structured(
        response_format=response_format,
        guided=NO_GUIDED | (guided or {}),
        structured_outputs=structured_outputs,
        has_tools=has_tools,
    )


def test_the_switches_ride_in_structured_outputs_with_its_constraint() -> None:
    params = resolve(structured_outputs={"json": SCHEMA, "close_at_budget": False, "loop_guard": True})
    assert params is not None and params.close_at_budget is False and params.loop_guard is True
    default = resolve(structured_outputs={"json": SCHEMA})
    assert default is not None and default.close_at_budget is None and default.loop_guard is None


def test_options_alone_apply_to_response_format_and_guided_fields() -> None:
    options = {"close_at_budget": False, "loop_guard": False, "whitespace": "flexible", "max_whitespace": 2}
    shaped = resolve(response_format=RESPONSE_FORMAT, structured_outputs=options)
    assert shaped is not None and shaped.to_spec().kind == "json_schema"
    assert (shaped.close_at_budget, shaped.loop_guard, shaped.whitespace, shaped.max_whitespace) == (
        False,
        False,
        "flexible",
        2,
    )
    assert shaped.strict is True  # response_format's own strict stays unless the options set it
    relaxed = resolve(response_format=RESPONSE_FORMAT, structured_outputs={"strict": False})
    assert relaxed is not None and relaxed.strict is False
    regex = resolve(guided={"guided_regex": "[ab]+"}, structured_outputs={"loop_guard": True})
    assert regex is not None and regex.regex == "[ab]+" and regex.loop_guard is True
    choice = resolve(guided={"guided_choice": ["x", "y"]}, structured_outputs={"close_at_budget": None})
    assert choice is not None and choice.choice == ["x", "y"] and choice.close_at_budget is None


def test_two_constraints_are_still_refused() -> None:
    with pytest.raises(APIError, match="at most one of response_format, structured_outputs") as raised:
        resolve(response_format=RESPONSE_FORMAT, structured_outputs={"regex": "a", "close_at_budget": False})
    assert raised.value.param == "response_format"
    with pytest.raises(APIError, match="at most one of guided_regex, guided_choice"):
        resolve(
            guided={"guided_regex": "a", "guided_choice": ["b"]}, structured_outputs={"loop_guard": False}
        )


def test_options_without_any_constraint_are_a_400_unless_tools_take_them() -> None:
    for structured_outputs in ({"close_at_budget": False}, {}):
        with pytest.raises(APIError, match="names no constraint") as raised:
            resolve(structured_outputs=structured_outputs)
        assert raised.value.status == 400 and raised.value.param == "structured_outputs"
    with pytest.raises(APIError, match="names no constraint"):  # response_format "text" constrains nothing
        resolve(response_format={"type": "text"}, structured_outputs={"loop_guard": False})
    assert resolve(structured_outputs={"close_at_budget": False}, has_tools=True) is None
    assert resolve() is None


@pytest.mark.parametrize(
    ("structured_outputs", "param"),
    [
        ({"json": SCHEMA, "close_at_budget": "yes"}, "structured_outputs.close_at_budget"),
        ({"close_at_budget": 1}, "structured_outputs.close_at_budget"),
        ({"loop_guard": "off"}, "structured_outputs.loop_guard"),
        ({"strict": "no"}, "structured_outputs.strict"),
        ({"strict": None}, "structured_outputs.strict"),
        ({"whitespace": "lots"}, "structured_outputs.whitespace"),
        ({"max_whitespace": 0}, "structured_outputs.max_whitespace"),
        ({"json": SCHEMA, "budget": True}, "structured_outputs"),
        ({"regex": ""}, "structured_outputs"),
    ],
)
def test_bad_options_are_400s_naming_the_option(structured_outputs: dict[str, Any], param: str) -> None:
    with pytest.raises(APIError) as raised:
        resolve(response_format=None, structured_outputs=structured_outputs, has_tools=True)
    assert raised.value.status == 400 and raised.value.param == param, raised.value.message


def test_a_bad_constraint_names_the_field_it_came_from() -> None:
    with pytest.raises(APIError) as raised:
        resolve(guided={"guided_choice": []})
    assert raised.value.param == "guided_choice"
    with pytest.raises(APIError) as raised:
        resolve(response_format={"type": "json_schema", "json_schema": {"name": "x"}})
    assert raised.value.param == "response_format"


def test_tool_calls_take_the_options() -> None:
    tool = {"type": "function", "function": {"name": "f", "parameters": SCHEMA}}
    plan = ToolCallPlan.build([tool], "required")
    options = structured_options({"close_at_budget": False, "loop_guard": True})
    params = plan.sampling_params(None, options=options)
    structured = params.structured_outputs
    assert structured is not None and structured.to_spec().kind == "grammar"
    assert structured.close_at_budget is False and structured.loop_guard is True
    plain = plan.sampling_params(None).structured_outputs
    assert plain is not None and plain.close_at_budget is None and plain.loop_guard is None
    assert structured_options(None) == {}
