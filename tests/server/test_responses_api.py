"""`POST /v1/responses` over the `tiny` engine through ASGI (random weights: the mechanics only): the Response
object the SDK's model accepts, usage, `incomplete`, text.format variants, tools, errors named in the Responses
API's terms, and the store (`GET` / `DELETE` / `cancel` / `input_items`, 404s, eviction, previous_response_id)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from openai.types.responses import Response as SDKResponse
from openai.types.responses import ResponseItemList
from server_helpers import KEY, assert_error, call

from structgen.cli import DEFAULT_RESPONSES_STORE_SIZE as CLI_STORE_SIZE
from structgen.engine.async_engine import AsyncEngine
from structgen.server import ServerLimits, build_app
from structgen.server.limits import DEFAULT_RESPONSES_STORE_SIZE

CITY = {
    "type": "object",
    "properties": {"city": {"type": "string", "enum": ["Oslo", "Rome"]}},
    "required": ["city"],
    "additionalProperties": False,
}
TOOLS = [{"type": "function", "name": "get_weather", "description": "Weather", "parameters": CITY}]
# A prompt longer than a few KV blocks (16 tokens each), so a follow-up finds it in the prefix cache.
STORY = "Remember this story about a lighthouse keeper who counted ships every night for forty years. " * 3


@pytest.fixture(scope="module")
def app(engine: AsyncEngine) -> Any:
    return build_app(engine, engine.engine.tokenizer, model_name="tiny", api_key=KEY)


def create(app: Any, **body: Any) -> dict[str, Any]:
    response = call(app, "POST", "/v1/responses", json={"model": "tiny", "max_output_tokens": 4} | body)
    assert response.status_code == 200, response.text
    data = response.json()
    SDKResponse.model_validate(data)  # every field the SDK's model requires, with the types it requires
    return data


def text_of(response: dict[str, Any]) -> str:
    return "".join(
        part["text"] for item in response["output"] if item["type"] == "message" for part in item["content"]
    )


def prompt_tokens(engine: AsyncEngine, messages: list[dict[str, Any]]) -> int:
    return len(engine.engine.tokenizer.encode_chat(messages))


def test_a_response_cut_by_its_budget_is_incomplete_with_usage(app: Any, engine: AsyncEngine) -> None:
    data = create(app, input="Give me a number.", ignore_eos=True, metadata={"run": "7"}, seed=5)
    assert data["object"] == "response" and data["id"].startswith("resp_") and data["model"] == "tiny"
    assert data["status"] == "incomplete" and data["incomplete_details"] == {"reason": "max_output_tokens"}
    assert data["completed_at"] is None and data["error"] is None and data["metadata"] == {"run": "7"}
    (message,) = data["output"]
    assert (
        message["type"] == "message" and message["role"] == "assistant" and message["status"] == "incomplete"
    )
    assert message["id"].startswith("msg_")
    (part,) = message["content"]
    assert part["type"] == "output_text" and part["annotations"] == [] and part["text"]
    input_tokens = prompt_tokens(engine, [{"role": "user", "content": "Give me a number."}])
    usage = data["usage"]
    assert usage["input_tokens"] == input_tokens and usage["output_tokens"] == 4
    assert usage["total_tokens"] == input_tokens + 4 and usage["output_tokens_details"] == {
        "reasoning_tokens": 0
    }
    assert usage["input_tokens_details"]["cached_tokens"] >= 0
    # The echoed request, with OpenAI's defaults.
    assert (data["max_output_tokens"], data["temperature"], data["top_p"]) == (4, 1.0, 1.0)
    assert (
        data["text"] == {"format": {"type": "text"}} and data["tool_choice"] == "auto" and data["tools"] == []
    )
    assert data["parallel_tool_calls"] is True and data["store"] is True and data["truncation"] == "disabled"
    # The same seed, the same text: the sampling fields reach the engine. Both repeats find the prompt in the
    # prefix cache: a first run computed it whole, and in bf16 the two paths' logits differ in the last bits,
    # enough to move a draw from a flat (random-weight) distribution to the next token.
    again = text_of(create(app, input="Give me a number.", ignore_eos=True, seed=5))
    assert text_of(create(app, input="Give me a number.", ignore_eos=True, seed=5)) == again


def test_a_finished_response_is_completed(app: Any) -> None:
    data = create(app, input="Yes or no?", guided_choice=["yes", "no"], max_output_tokens=8)
    assert data["status"] == "completed" and data["incomplete_details"] is None
    assert isinstance(data["completed_at"], int) and text_of(data) in ("yes", "no")
    assert data["output"][0]["status"] == "completed"


def test_every_input_form_gives_the_same_prompt(app: Any, engine: AsyncEngine) -> None:
    forms: list[Any] = [
        "Hi there",
        [{"role": "user", "content": "Hi there"}],
        [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hi there"}]}],
    ]
    expected = prompt_tokens(engine, [{"role": "user", "content": "Hi there"}])
    for form in forms:
        assert create(app, input=form, max_output_tokens=1)["usage"]["input_tokens"] == expected
    with_instructions = create(app, input="Hi there", instructions="Be brief.", max_output_tokens=1)
    assert with_instructions["instructions"] == "Be brief."
    assert with_instructions["usage"]["input_tokens"] == prompt_tokens(
        engine, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    )


def test_text_format_variants(app: Any) -> None:
    schema_format = {"type": "json_schema", "name": "city", "schema": CITY, "strict": True}
    shaped = create(app, input="A city?", text={"format": schema_format}, max_output_tokens=16)
    assert shaped["status"] == "completed" and json.loads(text_of(shaped))["city"] in ("Oslo", "Rome")
    assert shaped["text"] == {"format": schema_format}  # echoed as sent, flat
    assert shaped["structured"]["valid"] is True
    obj = create(app, input="An object?", text={"format": {"type": "json_object"}}, max_output_tokens=24)
    assert obj["status"] == "completed" and isinstance(json.loads(text_of(obj)), dict)
    plain = create(app, input="Text?", text={"format": {"type": "text"}})
    assert plain["structured"] is None and plain["text"] == {"format": {"type": "text"}}


def test_text_format_with_tools_shapes_the_answer_and_leaves_calls_free(app: Any) -> None:
    """As OpenAI has it (and instructor's RESPONSES_TOOLS mode sends): text.format is for a text answer; with
    a forced call there is none, with `auto` the answer is that JSON or calls."""
    schema_format = {"type": "json_schema", "name": "city", "schema": CITY, "strict": True}
    named = {"type": "function", "name": "get_weather"}
    called = create(
        app,
        input="Weather?",
        tools=TOOLS,
        tool_choice=named,
        text={"format": schema_format},
        max_output_tokens=40,
    )
    (item,) = called["output"]
    assert item["type"] == "function_call" and json.loads(item["arguments"])["city"] in ("Oslo", "Rome")
    for seed in range(4):
        either = create(
            app,
            input="Weather?",
            tools=TOOLS,
            text={"format": schema_format},
            max_output_tokens=40,
            seed=seed,
        )
        assert either["status"] == "completed", either
        for out in either["output"]:
            if out["type"] == "message":
                assert json.loads(out["content"][0]["text"])["city"] in ("Oslo", "Rome")
            else:
                assert out["type"] == "function_call" and out["name"] == "get_weather"


def test_function_tools_give_function_call_items(app: Any) -> None:
    data = create(
        app,
        input="Weather in Rome?",
        tools=TOOLS,
        tool_choice={"type": "function", "name": "get_weather"},
        parallel_tool_calls=False,
        max_output_tokens=40,
    )
    assert data["status"] == "completed"
    (item,) = data["output"]
    assert item["type"] == "function_call" and item["status"] == "completed" and item["name"] == "get_weather"
    assert item["id"].startswith("fc_") and item["call_id"].startswith("call_")
    assert json.loads(item["arguments"])["city"] in ("Oslo", "Rome")
    assert data["tools"] == [TOOLS[0] | {"strict": True}]  # strict defaults to true, as OpenAI's
    assert data["tool_choice"] == {"type": "function", "name": "get_weather"}
    assert data["parallel_tool_calls"] is False
    allowed = {
        "type": "allowed_tools",
        "mode": "required",
        "tools": [{"type": "function", "name": "get_weather"}],
    }
    chosen = create(app, input="Weather?", tools=TOOLS, tool_choice=allowed, max_output_tokens=40)
    assert [i["name"] for i in chosen["output"]] and {i["name"] for i in chosen["output"]} == {"get_weather"}


UNIQUE = {"type": "object", "properties": {"tags": {"type": "array", "uniqueItems": True}}}


@pytest.mark.parametrize(
    ("body", "status", "param", "words"),
    [
        ({}, 400, "input", ["input", "Field required"]),
        ({"input": []}, 400, "input", ["at least one item"]),
        ({"input": "x", "max_output_tokens": 0}, 400, "max_output_tokens", []),
        ({"input": "x", "temperature": 3}, 400, "temperature", []),
        ({"input": "x", "stream": "yes"}, 400, "stream", []),
        ({"input": "x", "metadata": {"k": "v" * 513}}, 400, "metadata", ["512"]),
        (
            {"input": "x", "text": {"format": {"type": "json_schema", "json_schema": {"schema": CITY}}}},
            400,
            "text.format.schema",
            ["flat"],
        ),
        (
            {"input": "x", "min_tokens": 9, "max_output_tokens": 5},
            400,
            "min_tokens",
            ["max_output_tokens (5)"],
        ),
        ({"input": "x", "tools": [{"type": "web_search"}]}, 400, "tools", ["only function tools"]),
        (
            {
                "input": "x",
                "tools": [{"type": "function", "name": "tag", "parameters": UNIQUE}],
                "tool_choice": "required",
            },
            400,
            "tools",
            ["'tag' is strict", "uniqueItems"],
        ),
        (
            {"input": "x", "tools": TOOLS, "tool_choice": {"type": "function", "name": "nope"}},
            400,
            "tool_choice",
            ["'nope'"],
        ),
        ({"input": "x", "tool_choice": "required"}, 400, "tool_choice", ["no tools"]),
        (
            {
                "input": "x",
                "tools": TOOLS,
                "tool_choice": {
                    "type": "allowed_tools",
                    "mode": "auto",
                    "tools": [{"type": "function", "name": "nope"}],
                },
            },
            400,
            "tool_choice.tools",
            ["'nope'"],
        ),
        (
            {"input": "x", "tools": TOOLS, "guided_regex": "[a-z]+"},
            400,
            "tool_choice",
            ["combine only with a JSON response format"],
        ),
        (
            {"input": "x", "text": {"format": {"type": "json_object"}}, "guided_regex": "a+"},
            400,
            "text.format",
            ["text.format, guided_regex"],
        ),
        ({"input": "x", "structured_outputs": {"loop_guard": 2}}, 400, "structured_outputs.loop_guard", []),
        ({"input": "x", "background": True, "store": False}, 400, "background", ["store=true"]),
        ({"input": "x", "model": "gpt-4o"}, 404, "model", ["'gpt-4o'"]),
        (
            {"input": "x", "previous_response_id": "resp_nope"},
            404,
            "previous_response_id",
            ["'resp_nope' not found"],
        ),
    ],
)
def test_errors_name_the_responses_field(
    app: Any, body: dict[str, Any], status: int, param: str, words: list[str]
) -> None:
    error = assert_error(call(app, "POST", "/v1/responses", json=body), status, *words)
    assert error["param"] == param, error


def test_a_strict_false_tool_takes_a_schema_that_needs_relaxing(app: Any) -> None:
    tool = {"type": "function", "name": "tag", "parameters": UNIQUE, "strict": False}
    data = create(app, input="Tag it.", tools=[tool], tool_choice="required", max_output_tokens=30)
    assert data["tools"][0]["strict"] is False and data["output"][0]["type"] in ("function_call", "message")


def test_stored_responses_get_delete_cancel_and_input_items(app: Any) -> None:
    items = [
        {"role": "user", "content": "one"},
        {"role": "user", "content": "two"},
        {"role": "user", "content": "three"},
    ]
    data = create(app, input=items)
    rid = data["id"]
    assert call(app, "GET", f"/v1/responses/{rid}").json() == data
    listed = call(app, "GET", f"/v1/responses/{rid}/input_items").json()
    ResponseItemList.model_validate(listed)
    texts = [item["content"][0]["text"] for item in listed["data"]]
    assert (
        texts == ["three", "two", "one"] and listed["has_more"] is False
    )  # newest first, as OpenAI's default
    page = call(app, "GET", f"/v1/responses/{rid}/input_items", params={"order": "asc", "limit": 2}).json()
    assert [i["content"][0]["text"] for i in page["data"]] == ["one", "two"] and page["has_more"] is True
    rest = call(
        app, "GET", f"/v1/responses/{rid}/input_items", params={"order": "asc", "after": page["last_id"]}
    )
    assert [i["content"][0]["text"] for i in rest.json()["data"]] == ["three"]
    assert_error(call(app, "GET", f"/v1/responses/{rid}/input_items", params={"limit": 0}), 400)
    error = assert_error(call(app, "POST", f"/v1/responses/{rid}/cancel"), 400, "background")
    assert error["code"] == "not_background"
    deleted = call(app, "DELETE", f"/v1/responses/{rid}")
    assert deleted.json() == {"id": rid, "object": "response.deleted", "deleted": True}
    for method, path in [
        ("GET", f"/v1/responses/{rid}"),
        ("DELETE", f"/v1/responses/{rid}"),
        ("POST", f"/v1/responses/{rid}/cancel"),
        ("GET", f"/v1/responses/{rid}/input_items"),
    ]:
        error = assert_error(call(app, method, path), 404, rid, "not found")
        assert error["type"] == "not_found_error" and error["code"] == "response_not_found"
    unstored = create(app, input="x", store=False)
    assert unstored["store"] is False
    assert_error(call(app, "GET", f"/v1/responses/{unstored['id']}"), 404)
    assert_error(
        call(app, "GET", "/v1/responses/x", headers=None), 401
    )  # behind the key like every /v1 route


def test_the_store_evicts_the_least_recently_used(engine: AsyncEngine) -> None:
    assert DEFAULT_RESPONSES_STORE_SIZE == CLI_STORE_SIZE == ServerLimits().responses_store_size == 1024
    small = build_app(
        engine, engine.engine.tokenizer, model_name="tiny", limits=ServerLimits(responses_store_size=2)
    )
    first, second = create(small, input="a"), create(small, input="b")
    assert (
        call(small, "GET", f"/v1/responses/{first['id']}", headers=None).status_code == 200
    )  # now the newest
    create(small, input="c")
    assert call(small, "GET", f"/v1/responses/{first['id']}", headers=None).status_code == 200
    assert_error(call(small, "GET", f"/v1/responses/{second['id']}", headers=None), 404, "evicted")
    follow_up = {"input": "d", "previous_response_id": second["id"]}
    error = assert_error(call(small, "POST", "/v1/responses", json=follow_up, headers=None), 404)
    assert error["param"] == "previous_response_id"
    with pytest.raises(ValueError, match="responses_store_size"):
        ServerLimits(responses_store_size=-1)


def test_previous_response_id_continues_the_conversation(app: Any, engine: AsyncEngine) -> None:
    first = create(app, input=STORY, instructions="Answer in one word.", ignore_eos=True)
    second = create(app, input="What did he count?", previous_response_id=first["id"], ignore_eos=True)
    assert second["previous_response_id"] == first["id"] and second["instructions"] is None
    # The stored input and output, then the new input; the first request's instructions are not carried over.
    conversation = [
        {"role": "user", "content": STORY},
        {"role": "assistant", "content": text_of(first)},
        {"role": "user", "content": "What did he count?"},
    ]
    assert second["usage"]["input_tokens"] == prompt_tokens(engine, conversation)
    conversation += [
        {"role": "assistant", "content": text_of(second)},
        {"role": "user", "content": "And then?"},
    ]
    third = create(app, input="And then?", previous_response_id=second["id"])
    assert third["usage"]["input_tokens"] == prompt_tokens(engine, conversation)
    # The conversation so far is one prefix: its KV blocks are reused from the second request.
    assert third["usage"]["input_tokens_details"]["cached_tokens"] >= 16
    kind = create(app, input="And then?", previous_response_id=second["id"], instructions="Be kind.")
    with_instructions = [{"role": "system", "content": "Be kind."}, *conversation]
    assert kind["usage"]["input_tokens"] == prompt_tokens(engine, with_instructions)
    listed = call(app, "GET", f"/v1/responses/{third['id']}/input_items").json()["data"]
    assert [i["content"][0]["text"] for i in listed] == ["And then?"]  # its own input items only


def test_a_tool_turn_through_previous_response_id_or_explicit_items_is_the_same_prompt(app: Any) -> None:
    ask = {"tools": TOOLS, "max_output_tokens": 40}
    first = create(app, input="Weather in Oslo?", tool_choice="required", parallel_tool_calls=False, **ask)
    (call_item,) = first["output"]
    result = {"type": "function_call_output", "call_id": call_item["call_id"], "output": '{"sky": "clear"}'}
    chained = create(app, input=[result], previous_response_id=first["id"], **ask)
    explicit = create(app, input=[{"role": "user", "content": "Weather in Oslo?"}, call_item, result], **ask)
    assert chained["usage"]["input_tokens"] == explicit["usage"]["input_tokens"]
    listed = call(app, "GET", f"/v1/responses/{explicit['id']}/input_items", params={"order": "asc"}).json()
    assert [i["type"] for i in listed["data"]] == ["message", "function_call", "function_call_output"]
    assert listed["data"][1]["id"] == call_item["id"]  # a client's own item ids are kept


def test_metrics_count_the_routes_by_template(engine: AsyncEngine) -> None:
    fresh = build_app(engine, engine.engine.tokenizer, model_name="tiny")
    create(fresh, input="x", max_output_tokens=1)
    call(fresh, "GET", "/v1/responses/resp_unknown", headers=None)
    text = call(fresh, "GET", "/metrics", headers=None).text
    assert 'structgen_http_requests_total{method="POST",route="/v1/responses",status="200"} 1.0' in text
    assert 'route="/v1/responses/{response_id}",status="404"} 1.0' in text  # the template, not the raw id
