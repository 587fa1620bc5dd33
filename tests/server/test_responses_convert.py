"""The Responses API's conversion layer without an engine: input items → chat messages, flat tools / tool_choice /
text.format → chat's shapes, chat errors renamed back, output items built from chat deltas, the LRU store."""

from __future__ import annotations

import json
from typing import Any

import pytest

from structgen.server import answers as a
from structgen.server import protocol as p
from structgen.server.errors import APIError
from structgen.server.responses.convert import (
    chat_request,
    chat_response_format,
    chat_tool_choice,
    chat_tools,
    echo_tools,
    input_items,
    responses_error,
    to_messages,
)
from structgen.server.responses.output import OutputItems, from_choice
from structgen.server.responses.protocol import ResponsesRequest
from structgen.server.responses.store import ResponseStore, StoredResponse

CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}


def request(**fields: Any) -> ResponsesRequest:
    return ResponsesRequest.model_validate({"input": "hi", **fields})


def raises(status: int, param: str | None, *words: str) -> Any:
    class Check:
        def __enter__(self) -> None:
            return None

        def __exit__(self, kind: Any, error: Any, tb: Any) -> bool:
            assert isinstance(error, APIError), error
            assert (error.status, error.param) == (status, param), (error.status, error.param, error.message)
            for word in words:
                assert word in error.message, error.message
            return True

    return Check()


def test_every_input_form_becomes_the_same_chat_messages() -> None:
    plain = to_messages(input_items("Hello"))
    assert plain == [{"role": "user", "content": "Hello"}]
    forms = [
        [{"role": "user", "content": "Hello"}],
        [{"type": "message", "role": "user", "content": "Hello"}],
        [
            {
                "role": "user",
                "content": [{"type": "input_text", "text": "Hel"}, {"type": "input_text", "text": "lo"}],
            }
        ],
    ]
    for form in forms:
        assert to_messages(input_items(form)) == plain
    items = input_items([{"role": "user", "content": "Hello"}])
    assert items[0]["id"].startswith("msg_") and items[0]["status"] == "completed"
    assert items[0]["content"] == [{"type": "input_text", "text": "Hello"}]


def test_a_tool_turn_becomes_assistant_tool_calls_and_tool_results() -> None:
    items = input_items(
        [
            {"role": "developer", "content": "Be brief."},
            {"role": "user", "content": "Weather in Oslo?"},
            {
                "type": "message",
                "role": "assistant",
                "content": [{"type": "output_text", "text": "Checking.", "annotations": []}],
            },
            {
                "type": "function_call",
                "call_id": "call_1",
                "name": "get_weather",
                "arguments": '{"city":"Oslo"}',
            },
            {
                "type": "function_call",
                "call_id": "call_2",
                "name": "get_weather",
                "arguments": '{"city":"Bergen"}',
            },
            {"type": "function_call_output", "call_id": "call_1", "output": "rain"},
            {
                "type": "function_call_output",
                "call_id": "call_2",
                "output": [{"type": "input_text", "text": "sun"}],
            },
        ]
    )
    calls = [
        {
            "id": f"call_{i}",
            "type": "function",
            "function": {"name": "get_weather", "arguments": f'{{"city":"{c}"}}'},
        }
        for i, c in ((1, "Oslo"), (2, "Bergen"))
    ]
    assert to_messages(items) == [
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": "Checking.", "tool_calls": calls},
        {"role": "tool", "tool_call_id": "call_1", "content": "rain"},
        {"role": "tool", "tool_call_id": "call_2", "content": "sun"},
    ]
    # Calls with no text before them make an assistant message of their own.
    alone = to_messages(items[:2] + items[3:4])
    assert alone[-1] == {"role": "assistant", "content": "", "tool_calls": calls[:1]}
    # Every message is one chat accepts (the developer role is chat's system).
    chat = p.ChatCompletionRequest.model_validate({"messages": to_messages(items)})
    assert [m.for_template()["role"] for m in chat.messages] == [
        "system",
        "user",
        "assistant",
        "tool",
        "tool",
    ]


@pytest.mark.parametrize(
    ("raw", "param", "words"),
    [
        ([], "input", ["at least one item"]),
        ([{"role": "robot", "content": "x"}], "input[0].role", ["robot"]),
        (
            [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}],
            "input[0].content[0].type",
            ["input_image"],
        ),
        (
            [{"type": "web_search_call"}],
            "input[0].type",
            ["'web_search_call'", "function_call_output", "reasoning"],
        ),
        ([{"type": "function_call", "name": "f", "arguments": "{}"}], "input[0].call_id", ["call_id"]),
        (["text"], "input[0]", ["must be an object"]),
    ],
)
def test_bad_input_items_name_the_item(raw: Any, param: str, words: list[str]) -> None:
    with raises(400, param, *words):
        input_items(raw)


def test_text_format_converts_from_the_flat_shape() -> None:
    assert chat_response_format({"type": "text"}) == {"type": "text"}
    assert chat_response_format({"type": "json_object"}) == {"type": "json_object"}
    flat = {"type": "json_schema", "name": "city", "schema": CITY, "strict": True}
    assert chat_response_format(flat) == {
        "type": "json_schema",
        "json_schema": {"name": "city", "schema": CITY, "strict": True},
    }
    with raises(400, "text.format.schema", "not under 'json_schema'"):
        chat_response_format({"type": "json_schema", "json_schema": {"name": "x", "schema": CITY}})
    with raises(400, "text.format.type", "'xml'"):
        chat_response_format({"type": "xml"})


def test_tools_convert_with_strict_true_by_default() -> None:
    tools = [
        {"type": "function", "name": "a", "description": "A", "parameters": CITY},
        {"type": "function", "name": "b", "parameters": CITY, "strict": False},
    ]
    assert chat_tools(tools) == [
        {
            "type": "function",
            "function": {"name": "a", "description": "A", "parameters": CITY, "strict": True},
        },
        {"type": "function", "function": {"name": "b", "parameters": CITY, "strict": False}},
    ]
    assert [t["strict"] for t in echo_tools(tools)] == [True, False]
    assert echo_tools(tools)[0] == {"type": "function", **tools[0], "strict": True}
    with raises(400, "tools", "only function tools", "'web_search'"):
        chat_tools([{"type": "web_search"}])
    with raises(400, "tools", "flat"):
        chat_tools([{"type": "function", "function": {"name": "a"}}])
    with raises(400, "tools", "tools[0].name"):
        chat_tools([{"type": "function", "parameters": CITY}])


def test_tool_choice_converts_to_chat_shapes() -> None:
    for plain in (None, "none", "auto", "required"):
        assert chat_tool_choice(plain) == plain
    assert chat_tool_choice({"type": "function", "name": "a"}) == {
        "type": "function",
        "function": {"name": "a"},
    }
    allowed = {"type": "allowed_tools", "mode": "required", "tools": [{"type": "function", "name": "b"}]}
    assert chat_tool_choice(allowed) == {
        "type": "allowed_tools",
        "allowed_tools": {"mode": "required", "tools": [{"type": "function", "function": {"name": "b"}}]},
    }
    with raises(400, "tool_choice.tools", "tools[0]"):
        chat_tool_choice({"type": "allowed_tools", "mode": "auto", "tools": [{"type": "mcp"}]})
    with raises(400, "tool_choice", '{"type": "function", "name": ...}'):
        chat_tool_choice({"type": "function", "function": {"name": "a"}})
    with raises(400, "tool_choice", 'got "any"'):
        chat_tool_choice("any")


def test_the_chat_request_carries_every_field() -> None:
    body = request(
        instructions="Answer in French.",
        max_output_tokens=7,
        temperature=0.5,
        top_p=0.9,
        text={"format": {"type": "json_object"}},
        tools=[{"type": "function", "name": "a", "parameters": CITY}],
        tool_choice={"type": "function", "name": "a"},
        parallel_tool_calls=False,
        stream=True,
        seed=3,
        top_k=5,
        stop=["\n"],
        structured_outputs={"loop_guard": False},
        include=["message.output_text.logprobs"],
        top_logprobs=2,
    )
    previous = input_items([{"role": "user", "content": "Earlier."}])
    chat = chat_request(body, context=previous, items=input_items(body.input))
    assert [(m.role, m.content) for m in chat.messages] == [
        ("system", "Answer in French."),
        ("user", "Earlier."),
        ("user", "hi"),
    ]
    assert chat.max_completion_tokens == 7 and chat.max_tokens_given
    assert (chat.temperature, chat.top_p, chat.seed, chat.top_k, chat.stop) == (0.5, 0.9, 3, 5, ["\n"])
    assert chat.response_format == {"type": "json_object"}
    assert chat.tools is not None and chat.tools[0]["function"]["strict"] is True
    assert chat.tool_choice == {"type": "function", "function": {"name": "a"}}
    assert chat.parallel_tool_calls is False and chat.structured_outputs == {"loop_guard": False}
    assert chat.stream and chat.stream_options is not None and chat.stream_options.include_usage
    assert chat.logprobs and chat.top_logprobs == 2
    bare = chat_request(request(), context=[], items=input_items("hi"))
    assert not bare.max_tokens_given and bare.response_format is None and not bare.logprobs


def test_chat_errors_are_renamed_to_responses_fields() -> None:
    cases = [
        (
            APIError(400, "response_format: bad schema at #/x", param="response_format"),
            "text.format",
            "text.format: bad",
        ),
        (APIError(400, "cannot apply the chat template", param="messages"), "input", "chat template"),
        (
            APIError(400, "min_tokens must be <= max_tokens", param="max_tokens"),
            "max_output_tokens",
            "<= max_output_tokens",
        ),
        (
            APIError(
                400, "tool_choice.allowed_tools.tools[0] names x", param="tool_choice.allowed_tools.tools"
            ),
            "tool_choice.tools",
            "tool_choice.tools[0]",
        ),
        (APIError(400, "tools[0] (f): invalid", param="tools"), "tools", "tools[0] (f)"),
    ]
    for error, param, message in cases:
        renamed = responses_error(error)
        assert (renamed.status, renamed.param, renamed.code) == (400, param, error.code)
        assert message in renamed.message


def call_delta(index: int, *, name: str | None = None, arguments: str = "") -> dict[str, Any]:
    delta: dict[str, Any] = {"index": index, "function": {"arguments": arguments}}
    if name is not None:
        delta |= {"id": f"call_{index}", "type": "function", "function": {"name": name, "arguments": ""}}
    return delta


def test_output_items_and_their_events() -> None:
    output = OutputItems()
    events = output.text("\n") + output.text("Hi") + output.text(" there")
    events += output.call("call_1", "f") + output.arguments('{"a"') + output.arguments(": 1}")
    events += output.call("call_2", "g") + output.arguments("{}") + output.finish("completed")
    assert [e["type"] for e in events] == [
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
    ]
    assert events[0]["item"]["content"] == [] and events[0]["item"]["status"] == "in_progress"
    assert events[2]["delta"] == "\nHi"  # leading whitespace waits for the text it belongs to
    message, first, second = output.items
    assert message["content"][0]["text"] == "\nHi there" and message["status"] == "completed"
    assert (first["name"], first["arguments"], first["call_id"]) == ("f", '{"a": 1}', "call_1")
    assert (second["name"], second["arguments"], second["status"]) == ("g", "{}", "completed")
    assert events[10] == {
        "type": "response.function_call_arguments.done",
        "item_id": first["id"],
        "output_index": 1,
        "name": "f",
        "arguments": '{"a": 1}',
    }
    assert [e["output_index"] for e in events if "output_index" in e] == [0] * 7 + [1] * 5 + [2] * 4


def test_whitespace_before_calls_is_no_message_and_an_empty_output_is_one() -> None:
    calls_only = OutputItems()
    calls_only.text("\n")
    calls_only.call("call_1", "f")
    calls_only.arguments("{}")
    calls_only.finish("completed")
    assert [i["type"] for i in calls_only.items] == ["function_call"]
    for texts in ([], ["  "]):
        empty = OutputItems()
        for text in texts:
            empty.text(text)
        events = empty.finish("incomplete")
        (item,) = empty.items
        assert item["type"] == "message" and item["status"] == "incomplete"
        assert item["content"][0]["text"] == "".join(texts)
        assert events[-1]["type"] == "response.output_item.done"


def test_a_plain_answer_has_the_items_a_stream_builds() -> None:
    calls = [{"id": "call_9", "type": "function", "function": {"name": "f", "arguments": '{"x": 2}'}}]
    choice = a.ChatChoice(
        index=0, message=a.AssistantMessage(content=None, tool_calls=calls), finish_reason="tool_calls"
    )
    items, status = from_choice(choice)
    assert status == "completed"
    assert [(i["type"], i["call_id"], i["name"], json.loads(i["arguments"])) for i in items] == [
        ("function_call", "call_9", "f", {"x": 2})
    ]
    cut = a.ChatChoice(index=0, message=a.AssistantMessage(content="abc"), finish_reason="length")
    items, status = from_choice(cut)
    assert status == "incomplete" and items[0]["status"] == "incomplete"
    assert items[0]["content"] == [{"type": "output_text", "text": "abc", "annotations": [], "logprobs": []}]


def stored(response_id: str) -> StoredResponse:
    return StoredResponse(response={"id": response_id}, input_items=[], context=[])


def test_the_store_is_a_bounded_lru() -> None:
    store = ResponseStore(2)
    store.put(stored("a"))
    store.put(stored("b"))
    store.get("a")  # read: now the most recently used
    store.put(stored("c"))
    assert len(store) == 2 and store.get("a").response["id"] == "a"
    with raises(404, None, "'b'", "evicted"):
        store.get("b")
    with raises(404, "previous_response_id", "Previous response with id 'b'"):
        store.get("b", param="previous_response_id")
    store.delete("a")
    with raises(404, None, "'a'"):
        store.delete("a")
    nothing = ResponseStore(0)
    nothing.put(stored("x"))
    assert len(nothing) == 0
    with pytest.raises(ValueError, match=">= 0"):
        ResponseStore(-1)
