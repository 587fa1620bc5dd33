from __future__ import annotations

import json

from tool_helpers import WEATHER_TOOLS

from structgen.models.registry import resolve_model
from structgen.tokenizer import Tokenizer
from structgen.tools import ToolCallPlan

CALL = {
    "id": "call_1",
    "type": "function",
    "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
}
LOOP = [
    {"role": "user", "content": "Weather in Oslo?"},
    {"role": "assistant", "content": None, "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 4}'},
    {"role": "tool", "tool_call_id": "call_2", "content": "windy"},
]


def test_template_without_tool_support_gets_them_written_in() -> None:
    smollm2 = Tokenizer.from_dir(resolve_model("smollm2-135m"))
    plan = ToolCallPlan.build(WEATHER_TOOLS, "auto", chat_template=smollm2.chat_template)
    assert not plan.template_supports_tools and plan.format.name == "hermes"
    messages, template_tools = plan.conversation(LOOP)
    assert template_tools is None
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user"]
    system = messages[0]["content"]
    assert "<tools>" in system and json.dumps(WEATHER_TOOLS[0]) in system and "<tool_call>" in system
    assert (
        messages[2]["content"]
        == '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    )
    assert messages[3]["content"] == (
        '<tool_response>\n{"temp": 4}\n</tool_response>\n<tool_response>\nwindy\n</tool_response>'
    )
    text = smollm2.apply_chat_template(messages, tools=template_tools)
    assert text.startswith("<|im_start|>system\n# Tools") and text.endswith("<|im_start|>assistant\n")


def test_an_existing_system_message_keeps_its_text() -> None:
    plan = ToolCallPlan.build(WEATHER_TOOLS, "required")
    messages, _ = plan.conversation([{"role": "system", "content": "Be brief."}, LOOP[0]])
    assert messages[0]["content"].startswith("Be brief.\n\n# Tools")
    assert len(messages) == 2


def test_tool_choice_none_shows_no_tools_but_keeps_the_history() -> None:
    plan = ToolCallPlan.build(WEATHER_TOOLS, "none")
    messages, template_tools = plan.conversation(LOOP)
    assert template_tools is None and messages[0]["role"] == "user"
    assert "<tool_call>" in messages[1]["content"]


def test_template_with_tool_support_renders_them_itself() -> None:
    tiny = Tokenizer.from_dir(resolve_model("tiny"))
    plan = ToolCallPlan.build(WEATHER_TOOLS, "auto", chat_template=tiny.chat_template)
    assert plan.template_supports_tools
    messages, template_tools = plan.conversation(LOOP)
    assert template_tools == WEATHER_TOOLS
    assert messages[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Oslo"}
    assert (
        LOOP[1]["tool_calls"][0]["function"]["arguments"] == '{"city": "Oslo"}'
    )  # the caller's copy is untouched
    text = tiny.apply_chat_template(messages, tools=template_tools)
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>' in text
    assert "<tool_response>\nwindy\n</tool_response>" in text
