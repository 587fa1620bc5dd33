"""Chat templates: our rendering equals transformers' `apply_chat_template` on the same directory."""

from __future__ import annotations

import datetime
import json
from pathlib import Path
from typing import Any

import pytest
from tokenizer_fixtures import build_sentencepiece_style_tokenizer

from structgen.tokenizer import ChatTemplateError, Tokenizer

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city <with> 'quotes' & ünïcode",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
            "required": ["city"],
        },
    },
}
TIME_TOOL = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}

CONVERSATIONS: dict[str, list[dict[str, Any]]] = {
    "user_only": [{"role": "user", "content": "Hi there! 🎉"}],
    "system_user": [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Name three colours."},
    ],
    "multi_turn": [
        {"role": "system", "content": "Answer in JSON."},
        {"role": "user", "content": "Who is Maria?"},
        {"role": "assistant", "content": '{"name": "Maria"}'},
        {"role": "user", "content": "And her age?"},
    ],
    "tool_round_trip": [
        {"role": "system", "content": "Use tools when useful."},
        {"role": "user", "content": "Weather and time in Lisbon?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Lisbon"}'},
                },
                {
                    "id": "call_2",
                    "type": "function",
                    "function": {"name": "get_time", "arguments": {"tz": "WET"}},
                },
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temp_c": 21}'},
        {"role": "tool", "tool_call_id": "call_2", "content": "14:05"},
        {"role": "assistant", "content": "It is 21 °C and 14:05 in Lisbon."},
        {"role": "user", "content": "Thanks"},
    ],
    "content_and_call": [
        {"role": "user", "content": "Weather?"},
        {
            "role": "assistant",
            "content": "Let me check.",
            "tool_calls": [{"function": {"name": "get_weather", "arguments": {"city": "Porto"}}}],
        },
        {"role": "tool", "content": "sunny"},
    ],
}


@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
@pytest.mark.parametrize("with_tools", [False, True])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_tiny_template_matches_transformers(
    tiny_tokenizer, hf_tiny, name, with_tools, add_generation_prompt
) -> None:
    messages = CONVERSATIONS[name]
    tools = [WEATHER_TOOL, TIME_TOOL] if with_tools else None
    ours = tiny_tokenizer.apply_chat_template(
        messages, tools=tools, add_generation_prompt=add_generation_prompt
    )
    theirs = hf_tiny.apply_chat_template(
        messages, tools=tools, add_generation_prompt=add_generation_prompt, tokenize=False
    )
    assert ours == theirs
    ids = tiny_tokenizer.encode_chat(messages, tools=tools, add_generation_prompt=add_generation_prompt)
    assert ids == hf_tiny.apply_chat_template(
        messages, tools=tools, add_generation_prompt=add_generation_prompt, tokenize=True, return_dict=False
    )


def test_tiny_template_renders_chatml_and_tool_calls(tiny_tokenizer) -> None:
    text = tiny_tokenizer.apply_chat_template(CONVERSATIONS["tool_round_trip"], tools=[WEATHER_TOOL])
    assert text.startswith("<|im_start|>system\nUse tools when useful.\n\n# Tools\n")
    assert json.dumps(WEATHER_TOOL, ensure_ascii=False) in text  # tools as plain JSON, not HTML-escaped
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Lisbon"}}\n</tool_call>' in text
    assert '<tool_call>\n{"name": "get_time", "arguments": {"tz": "WET"}}\n</tool_call>' in text
    assert (
        '<|im_start|>user\n<tool_response>\n{"temp_c": 21}\n</tool_response>\n<tool_response>\n14:05\n'
        in text
    )
    assert text.endswith("<|im_start|>user\nThanks<|im_end|>\n<|im_start|>assistant\n")
    ids = tiny_tokenizer.encode_chat(CONVERSATIONS["tool_round_trip"], tools=[WEATHER_TOOL])
    assert ids.count(100264) == text.count("<|im_start|>") and 100261 in ids  # markers are single tokens


def test_tiny_template_rejects_bad_roles(tiny_tokenizer) -> None:
    with pytest.raises(ChatTemplateError, match="unknown message role: robot"):
        tiny_tokenizer.apply_chat_template([{"role": "robot", "content": "beep"}])
    with pytest.raises(ChatTemplateError, match="system message may only come first"):
        tiny_tokenizer.apply_chat_template(
            [{"role": "user", "content": "a"}, {"role": "system", "content": "b"}]
        )


def test_content_parts_are_joined_for_string_templates(tiny_tokenizer) -> None:
    parts = [
        {"role": "user", "content": [{"type": "text", "text": "first"}, {"type": "text", "text": "second"}]}
    ]
    joined = [{"role": "user", "content": "first\nsecond"}]
    assert tiny_tokenizer.apply_chat_template(parts) == tiny_tokenizer.apply_chat_template(joined)
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]
    with pytest.raises(ChatTemplateError, match=r"messages\[0\]\.content\[0\] is a image_url content part"):
        tiny_tokenizer.apply_chat_template(image)


def test_template_that_iterates_content_gets_parts(tiny_tokenizer, hf_tiny) -> None:
    template = (
        "{% for m in messages %}{{ m.role }}:{% if m.content is string %}{{ m.content }}{% else %}"
        "{% for part in m.content %}[{{ part.type }}={{ part.text }}]{% endfor %}{% endif %}\n{% endfor %}"
    )
    messages = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    ours = tiny_tokenizer.apply_chat_template(messages, chat_template=template)
    assert ours == "user:[text=a][text=b]"  # trim_blocks eats the newline after a block tag
    assert ours == hf_tiny.apply_chat_template(messages, chat_template=template, tokenize=False)


def test_sentencepiece_template_and_no_double_bos(sp_tokenizer, hf_sp) -> None:
    messages = CONVERSATIONS["multi_turn"][1:]
    text = sp_tokenizer.apply_chat_template(messages)
    assert text == hf_sp.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text.startswith("<s>[INST] Who is Maria? [/INST]")
    ids = sp_tokenizer.encode_chat(messages)
    assert ids == hf_sp.apply_chat_template(
        messages, tokenize=True, add_generation_prompt=True, return_dict=False
    )
    assert ids[0] == 1 and ids.count(1) == 1  # the template wrote the BOS; encoding added none
    with pytest.raises(ChatTemplateError, match="roles must alternate"):
        sp_tokenizer.apply_chat_template([{"role": "assistant", "content": "first"}])


FEATURES_TEMPLATE = (
    "{{ bos_token }}|{{ eos_token }}|{{ pad_token is defined }}|{{ extra | tojson }}|{{ extra | tojson(indent=2) }}"
    "|{{ extra | tojson(sort_keys=true, separators=(',', ':')) }}|{{ extra | tojson(ensure_ascii=true) }}|"
    "{% for m in messages %}{% if loop.index > 2 %}{% break %}{% endif %}{% if m.role == 'skip' %}{% continue %}"
    "{% endif %}{{ m.content }};{% endfor %}|{% generation %}gen{% endgeneration %}|{{ tools is none }}"
    "|{{ documents is none }}|{{ add_generation_prompt }}|{{ messages[0].keys() | list | tojson }}"
)


def test_jinja_environment_matches_transformers(tiny_tokenizer, hf_tiny) -> None:
    extra = {"b": "<html> & 'q'", "a": ["ü", 1, None, True]}
    messages = [
        {"role": "user", "content": "one", "name": None},
        {"role": "skip", "content": "two"},
        {"role": "user", "content": "three"},
    ]
    ours = tiny_tokenizer.apply_chat_template(messages, chat_template=FEATURES_TEMPLATE, extra=extra)
    theirs = hf_tiny.apply_chat_template(
        messages, chat_template=FEATURES_TEMPLATE, extra=extra, tokenize=False, add_generation_prompt=True
    )
    assert ours == theirs
    assert ours.startswith("<|endoftext|>|<|im_end|>|True|" + json.dumps(extra, ensure_ascii=False) + "|")
    assert "|one;|gen|True|True|True|" in ours
    assert ours.endswith('["role", "content"]')  # the None-valued key was dropped


def test_strftime_now_and_reasoning_alias(tiny_tokenizer) -> None:
    year = datetime.datetime.now().strftime("%Y")
    assert tiny_tokenizer.apply_chat_template([], chat_template="{{ strftime_now('%Y') }}") in (
        year,
        str(int(year) + 1),
    )
    template = "{{ messages[0].reasoning_content }}/{{ messages[0].thinking }}"
    assert tiny_tokenizer.apply_chat_template(
        [{"role": "assistant", "reasoning": "hmm"}], chat_template=template
    ) == ("hmm/hmm")


def test_sandbox_and_bad_input_errors(tiny_tokenizer) -> None:
    with pytest.raises(ChatTemplateError, match="rejected"):
        tiny_tokenizer.apply_chat_template([], chat_template="{{ ''.__class__.__mro__ }}")
    with pytest.raises(ChatTemplateError, match="does not compile"):
        tiny_tokenizer.apply_chat_template([], chat_template="{% for %}")
    with pytest.raises(ChatTemplateError, match="list of message dicts"):
        tiny_tokenizer.apply_chat_template("hello")  # type: ignore[arg-type]
    with pytest.raises(ChatTemplateError, match=r"messages\[1\] has no string 'role'"):
        tiny_tokenizer.apply_chat_template([{"role": "user", "content": "a"}, {"content": "b"}])
    with pytest.raises(ChatTemplateError, match="tools must be a list"):
        tiny_tokenizer.apply_chat_template([{"role": "user", "content": "a"}], tools={"a": 1})  # type: ignore[arg-type]


def _write_config(model_dir: Path, **changes: Any) -> None:
    path = model_dir / "tokenizer_config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config))


def test_template_sources_and_named_templates(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    d = build_sentencepiece_style_tokenizer(tmp_path / "sp")
    messages = [{"role": "user", "content": "hi"}]
    tools = [WEATHER_TOOL]

    # chat_template.jinja (current transformers) wins over the config's template.
    (d / "chat_template.jinja").write_text("jinja:{{ messages[0].content }}")
    assert Tokenizer.from_dir(d).apply_chat_template(messages) == "jinja:hi"
    (d / "chat_template.jinja").unlink()

    # A list of named templates: 'default' normally, 'tool_use' when tools are given, any by name.
    _write_config(
        d,
        chat_template=[
            {"name": "default", "template": "default:{{ messages[0].content }}"},
            {"name": "tool_use", "template": "tools:{{ tools[0].function.name }}"},
            {"name": "rag", "template": "rag:{{ documents | length }}"},
        ],
    )
    ours, theirs = Tokenizer.from_dir(d), AutoTokenizer.from_pretrained(d)
    for kwargs in (
        {},
        {"tools": tools},
        {"chat_template": "rag", "documents": [{"title": "t", "text": "x"}]},
    ):
        expected = theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kwargs)
        assert ours.apply_chat_template(messages, **kwargs) == expected
    assert ours.apply_chat_template(messages, tools=tools) == "tools:get_weather"

    # chat_templates/*.jinja add named templates next to chat_template.jinja.
    _write_config(d, chat_template=None)
    (d / "chat_template.jinja").write_text("file-default")
    (d / "chat_templates").mkdir()
    (d / "chat_templates" / "tool_use.jinja").write_text("file-tools")
    ours = Tokenizer.from_dir(d)
    assert ours.apply_chat_template(messages) == "file-default"
    assert ours.apply_chat_template(messages, tools=tools) == "file-tools"

    (d / "chat_template.jinja").unlink()
    ours = Tokenizer.from_dir(d)
    with pytest.raises(ChatTemplateError, match="none is 'default'"):
        ours.apply_chat_template(messages)

    (d / "chat_templates" / "tool_use.jinja").unlink()
    ours = Tokenizer.from_dir(d)
    assert ours.chat_template is None
    with pytest.raises(ChatTemplateError, match="no chat template"):
        ours.apply_chat_template(messages)
