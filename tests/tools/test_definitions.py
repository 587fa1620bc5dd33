from __future__ import annotations

import copy

import openai
import pytest
from pydantic import BaseModel
from tool_helpers import WEATHER_TOOLS

from structgen.tools import ToolChoice, ToolError, parse_tool_choice, parse_tools


def test_parse_tools_reads_openai_definitions() -> None:
    tools = parse_tools(WEATHER_TOOLS)
    assert [t.name for t in tools] == ["get_weather", "get_time"]
    assert tools[0].description == "Current weather in a city"
    assert tools[0].to_openai() == WEATHER_TOOLS[0]
    assert tools[1].description is None


def test_parameters_default_to_an_empty_object() -> None:
    (tool,) = parse_tools([{"type": "function", "function": {"name": "ping"}}])
    assert tool.parameters == {"type": "object", "properties": {}}


def test_pydantic_function_tool_is_accepted() -> None:
    class Lookup(BaseModel):
        query: str
        limit: int = 3

    (tool,) = parse_tools([openai.pydantic_function_tool(Lookup)])
    assert tool.name == "Lookup"
    assert tool.strict
    assert set(tool.parameters["properties"]) == {"query", "limit"}


def test_duplicate_names_are_rejected_naming_both() -> None:
    with pytest.raises(
        ToolError, match=r"tools\[2\]: duplicate function name 'get_weather' \(also tools\[0\]\)"
    ):
        parse_tools([*WEATHER_TOOLS, WEATHER_TOOLS[0]])


@pytest.mark.parametrize(
    ("parameters", "message"),
    [
        (
            {"type": "object", "properties": {"city": {"type": "strin"}}},
            r"get_weather\).*properties/city/type",
        ),
        ({"type": "array"}, r"get_weather\): parameters must describe an object"),
        ("city", r"get_weather\): parameters must be a JSON Schema object"),
        ({"type": "object", "required": "city"}, r"get_weather\): invalid parameters schema"),
    ],
)
def test_invalid_parameters_name_the_tool(parameters: object, message: str) -> None:
    tool = copy.deepcopy(WEATHER_TOOLS[0])
    tool["function"]["parameters"] = parameters
    with pytest.raises(ToolError, match=message):
        parse_tools([tool])


@pytest.mark.parametrize(
    "bad",
    [
        {"type": "retrieval"},
        {"type": "function"},
        {"type": "function", "function": {"name": ""}},
        {"type": "function", "function": {"name": "has space"}},
        "get_weather",
    ],
)
def test_malformed_tools_are_rejected(bad: object) -> None:
    with pytest.raises(ToolError, match=r"tools\[0\]"):
        parse_tools([bad])


def test_tool_choice_modes() -> None:
    tools = parse_tools(WEATHER_TOOLS)
    assert parse_tool_choice(None, tools) == ToolChoice("auto")
    assert parse_tool_choice(None, []) == ToolChoice("none")
    assert parse_tool_choice("required", tools, parallel_tool_calls=False) == ToolChoice(
        "required", parallel=False
    )
    assert parse_tool_choice("none", tools).mode == "none"
    named = parse_tool_choice({"type": "function", "function": {"name": "get_time"}}, tools)
    assert named == ToolChoice("named", name="get_time")


@pytest.mark.parametrize(
    ("choice", "message"),
    [
        (
            {"type": "function", "function": {"name": "get_stock"}},
            "'get_stock', which is not among the tools",
        ),
        ("sometimes", "tool_choice must be 'none', 'auto', 'required'"),
        ({"type": "function", "function": {}}, "tool_choice.function.name must be a string"),
    ],
)
def test_bad_tool_choice(choice: object, message: str) -> None:
    with pytest.raises(ToolError, match=message) as error:
        parse_tool_choice(choice, parse_tools(WEATHER_TOOLS))
    assert error.value.param == "tool_choice"


def test_allowed_tools_narrow_auto_and_required() -> None:
    tools = parse_tools(WEATHER_TOOLS)
    chat = {
        "type": "allowed_tools",
        "allowed_tools": {
            "mode": "required",
            "tools": [{"type": "function", "function": {"name": "get_time"}}],
        },
    }
    choice = parse_tool_choice(chat, tools, parallel_tool_calls=False)
    assert choice == ToolChoice("required", parallel=False, allowed=("get_time",))
    assert choice.permits("get_time") and not choice.permits("get_weather")
    # The Responses API's flat tool reference; mode defaults to auto.
    flat = {
        "type": "allowed_tools",
        "allowed_tools": {"tools": [{"type": "function", "name": "get_weather"}]},
    }
    assert parse_tool_choice(flat, tools) == ToolChoice("auto", allowed=("get_weather",))
    assert ToolChoice("auto").permits("anything")


@pytest.mark.parametrize(
    ("allowed", "message", "param"),
    [
        (
            {"mode": "sometimes", "tools": [{"name": "get_time"}]},
            "mode must be 'auto' or 'required'",
            ".mode",
        ),
        ({"mode": "auto", "tools": []}, "tools must be a non-empty list", ".tools"),
        ({"mode": "auto", "tools": [{"name": "get_stock"}]}, "'get_stock', which is not among", ".tools"),
        ({"mode": "auto", "tools": [{"type": "function"}]}, r"tools\[0\] must be", ".tools"),
        (None, "must be an object with 'mode' and 'tools'", ""),
    ],
)
def test_bad_allowed_tools(allowed: object, message: str, param: str) -> None:
    choice = {"type": "allowed_tools", "allowed_tools": allowed}
    with pytest.raises(ToolError, match=message) as error:
        parse_tool_choice(choice, parse_tools(WEATHER_TOOLS))
    assert error.value.param == "tool_choice.allowed_tools" + param


def test_tool_choice_without_tools() -> None:
    with pytest.raises(ToolError, match="tool_choice is set but no tools were given"):
        parse_tool_choice("required", [])
