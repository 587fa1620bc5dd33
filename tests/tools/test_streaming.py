from __future__ import annotations

import json

import pytest
from tool_helpers import WEATHER_TOOLS

from structgen.tools import FORMATS, StreamingToolParser, parse_tools

CALLS = [("get_weather", '{"city": "Vienna", "unit": "c"}'), ("get_time", '{"zone": "Europe/Vienna"}')]


def _stream(parser: StreamingToolParser, text: str, step: int) -> tuple[str, list[dict], object]:
    content, deltas = "", []
    for i in range(0, len(text), step):
        out = parser.feed(text[i : i + step])
        content += out.content
        deltas.extend(out.tool_calls)
    rest, parsed = parser.finish()
    return content + rest.content, deltas + rest.tool_calls, parsed


@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("step", [1, 3, 1000])
def test_deltas_rebuild_the_calls(fmt: str, step: int) -> None:
    form = FORMATS[fmt]
    text = "Checking both.\n" + form.render_block(CALLS)
    content, deltas, parsed = _stream(StreamingToolParser(form, parse_tools(WEATHER_TOOLS)), text, step)
    assert content == "Checking both.\n"
    # Per call: the first delta has index, id, type and name (empty arguments), then argument fragments.
    heads = [d for d in deltas if "id" in d]
    assert [(d["index"], d["type"], d["function"]) for d in heads] == [
        (0, "function", {"name": "get_weather", "arguments": ""}),
        (1, "function", {"name": "get_time", "arguments": ""}),
    ]
    for index, (_, arguments) in enumerate(CALLS):
        mine = [d for d in deltas if d["index"] == index]
        assert mine[0] is heads[index]
        assert all(set(d) == {"index", "function"} and set(d["function"]) == {"arguments"} for d in mine[1:])
        assert "".join(d["function"]["arguments"] for d in mine) == arguments
        assert parsed.calls[index].id == heads[index]["id"]
        assert json.loads(parsed.calls[index].arguments) == json.loads(arguments)
    if step == 1:
        assert len([d for d in deltas if d["index"] == 0]) > 5  # the arguments really stream


def test_a_partial_trigger_is_held_back_then_released() -> None:
    parser = StreamingToolParser(FORMATS["hermes"])
    assert parser.feed("a <tool_").content == "a "
    assert parser.feed("box> b").content == "<tool_box> b"
    assert parser.feed(" <tool").content == " "
    rest, parsed = parser.finish()
    assert rest.content == "<tool"
    assert parsed.calls == [] and parsed.content == "a <tool_box> b <tool"


def test_escaped_quotes_and_braces_inside_strings() -> None:
    form = FORMATS["hermes"]
    arguments = '{"city": "Vi}en\\"na{", "unit": "c"}'
    _, deltas, parsed = _stream(StreamingToolParser(form), form.render_block([("get_weather", arguments)]), 1)
    assert "".join(d["function"]["arguments"] for d in deltas) == arguments
    assert json.loads(parsed.calls[0].arguments) == {"city": 'Vi}en"na{', "unit": "c"}
