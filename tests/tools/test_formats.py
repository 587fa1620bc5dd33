from __future__ import annotations

import json

import pytest
from tool_helpers import WEATHER_TOOLS

from structgen.models.registry import resolve_model
from structgen.tokenizer import Tokenizer
from structgen.tools import FORMATS, ToolCallFormat, detect_format, parse_tool_calls, parse_tools

CALLS = [("get_weather", '{"city": "Vienna", "unit": "c"}'), ("get_time", '{"zone": "Europe/Vienna"}')]


@pytest.mark.parametrize("fmt", FORMATS.values(), ids=list(FORMATS))
def test_rendered_block_parses_back(fmt: ToolCallFormat) -> None:
    parsed = parse_tool_calls(fmt.render_block(CALLS), fmt, parse_tools(WEATHER_TOOLS))
    assert parsed.content is None and parsed.complete and parsed.valid
    assert [(c.name, c.arguments) for c in parsed.calls] == CALLS
    assert all(c.id.startswith("call_") and len(c.id) > 10 for c in parsed.calls)
    assert len({c.id for c in parsed.calls}) == 2
    assert parsed.calls[0].to_openai() == {
        "id": parsed.calls[0].id,
        "type": "function",
        "function": {"name": "get_weather", "arguments": CALLS[0][1]},
    }


def test_format_texts() -> None:
    assert FORMATS["hermes"].render_block(CALLS[:1]) == (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Vienna", "unit": "c"}}\n</tool_call>'
    )
    assert FORMATS["llama3_json"].render_block(CALLS) == (
        '{"name": "get_weather", "parameters": {"city": "Vienna", "unit": "c"}}; '
        '{"name": "get_time", "parameters": {"zone": "Europe/Vienna"}}'
    )
    assert FORMATS["mistral"].render_block(CALLS[:1]) == (
        '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Vienna", "unit": "c"}}]'
    )


def test_text_before_the_calls_is_content() -> None:
    fmt = FORMATS["hermes"]
    parsed = parse_tool_calls("Let me check.\n" + fmt.render_block(CALLS[:1]), fmt)
    assert parsed.content == "Let me check.\n"
    assert [c.name for c in parsed.calls] == ["get_weather"]


def test_plain_text_has_no_calls() -> None:
    parsed = parse_tool_calls("It is sunny.", FORMATS["hermes"])
    assert parsed.content == "It is sunny." and parsed.calls == [] and parsed.complete


def test_truncated_block_is_incomplete() -> None:
    fmt = FORMATS["hermes"]
    text = fmt.render_block(CALLS)
    parsed = parse_tool_calls(text[: len(text) - 20], fmt)
    assert [c.name for c in parsed.calls] == ["get_weather"]
    assert not parsed.complete and not parsed.valid
    assert not parse_tool_calls(text[:30], fmt).calls


def test_calls_are_checked_against_the_tools() -> None:
    fmt = FORMATS["hermes"]
    text = fmt.render_block([("get_weather", '{"town": "Vienna"}'), ("get_stock", "{}")])
    parsed = parse_tool_calls(text, fmt, parse_tools(WEATHER_TOOLS))
    assert "'city' is a required property" in (parsed.calls[0].error or "")
    assert parsed.calls[1].error == "'get_stock' is not one of the tools"
    assert not parsed.valid


def test_unconstrained_variants_are_read() -> None:
    # Outside a grammar (tool_choice="auto" text that a model wrote itself): spacing, string arguments.
    text = '<tool_call> {"name":"get_time","arguments":"{\\"zone\\":\\"Asia/Tokyo\\"}"} </tool_call>'
    parsed = parse_tool_calls(text, FORMATS["hermes"])
    assert [(c.name, json.loads(c.arguments)) for c in parsed.calls] == [("get_time", {"zone": "Asia/Tokyo"})]


def test_detect_format_from_templates() -> None:
    for name in ("tiny", "smollm2-135m"):
        template = Tokenizer.from_dir(resolve_model(name)).chat_template
        assert detect_format(template).name == "hermes"
    assert detect_format("{{ '[TOOL_CALLS]' }}").name == "mistral"
    llama = '<|start_header_id|>ipython<|end_header_id|>{"name": function name, "parameters": ...}'
    assert detect_format(llama).name == "llama3_json"
    assert detect_format(None).name == "hermes"
