"""The OpenAI-compatible server over the `tiny` model: response shapes, streaming, usage, structured outputs,
the OpenAI error bodies, auth, and the official `openai` SDK against a real uvicorn on loopback."""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from live_server import serve, wait_idle
from server_helpers import AUTH, KEY, USER, assert_error, call, sse_events
from server_helpers import TINY_KV_CACHE_TOKENS as KV_CACHE_TOKENS

from structgen.engine.async_engine import AsyncEngine
from structgen.server import build_app


@pytest.fixture(scope="module")
def app(engine: AsyncEngine) -> Any:
    return build_app(engine, engine.engine.tokenizer, model_name="tiny", api_key=KEY)


# -- shapes over ASGI -----------------------------------------------------------------------------------------


def test_health_is_open_and_models_need_the_key(app: Any, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="structgen.server"):
        assert call(app, "GET", "/health", headers=None).json() == {"status": "ok"}
    (line,) = [r.getMessage() for r in caplog.records if r.name == "structgen.server"]
    assert "GET /health 200" in line
    assert_error(call(app, "GET", "/v1/models", headers=None), 401, "API key")
    assert_error(call(app, "GET", "/v1/models", headers={"Authorization": "Bearer wrong"}), 401)
    models = call(app, "GET", "/v1/models").json()
    assert models["object"] == "list" and [m["id"] for m in models["data"]] == ["tiny"]


def test_without_a_key_every_route_is_open(engine: AsyncEngine) -> None:
    open_app = build_app(engine, engine.engine.tokenizer, model_name="tiny")
    assert call(open_app, "GET", "/v1/models", headers=None).status_code == 200


def test_chat_completion_shape_usage_and_n(app: Any, engine: AsyncEngine) -> None:
    body = {
        "model": "tiny",
        "messages": USER,
        "max_completion_tokens": 4,
        "n": 3,
        "seed": 3,
        "temperature": 0.9,
    }
    body |= {"ignore_eos": True, "some_unknown_field": {"is": "ignored"}}
    response = call(app, "POST", "/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    data = response.json()
    assert (
        data["id"].startswith("chatcmpl-") and data["object"] == "chat.completion" and data["model"] == "tiny"
    )
    assert isinstance(data["created"], int)
    assert [c["index"] for c in data["choices"]] == [0, 1, 2]
    for choice in data["choices"]:
        assert choice["message"]["role"] == "assistant" and choice["message"]["refusal"] is None
        assert choice["finish_reason"] == "length" and choice["message"]["content"]
    prompt_tokens = len(engine.engine.tokenizer.encode_chat(USER))
    assert data["usage"] == {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": 12,
        "total_tokens": prompt_tokens + 12,
    }


def test_streamed_and_plain_completions_agree_for_a_seed(app: Any) -> None:
    body = {"model": "tiny", "prompt": ["Once upon", "a time"], "max_tokens": 6, "n": 2, "seed": 11}
    body |= {"temperature": 0.8, "ignore_eos": True}
    plain = call(app, "POST", "/v1/completions", json=body).json()
    assert plain["id"].startswith("cmpl-") and plain["object"] == "text_completion"
    assert len(plain["choices"]) == 4 and plain["usage"]["completion_tokens"] == 24
    stream = sse_events(
        call(
            app,
            "POST",
            "/v1/completions",
            json=body | {"stream": True, "stream_options": {"include_usage": True}},
        )
    )
    texts = ["", "", "", ""]
    finish = [None] * 4
    for event in stream[:-1]:
        (choice,) = event["choices"]
        texts[choice["index"]] += choice["text"]
        finish[choice["index"]] = choice["finish_reason"] or finish[choice["index"]]
    assert texts == [c["text"] for c in plain["choices"]]
    assert finish == ["length"] * 4
    assert stream[-1]["choices"] == [] and stream[-1]["usage"] == plain["usage"]


def test_chat_stream_chunks(app: Any) -> None:
    body = {"model": "tiny", "messages": USER, "max_tokens": 5, "stream": True, "ignore_eos": True}
    events = sse_events(call(app, "POST", "/v1/chat/completions", json=body))
    assert all(e["object"] == "chat.completion.chunk" and e["id"].startswith("chatcmpl-") for e in events)
    assert events[0]["choices"][0]["delta"]["role"] == "assistant"
    assert events[-1]["choices"][0]["finish_reason"] == "length"
    assert "".join(e["choices"][0]["delta"]["content"] or "" for e in events)
    assert all(e.get("usage") is None for e in events)  # no include_usage: no usage chunk


def test_guided_regex_and_choice_finish_and_match(app: Any) -> None:
    regex = call(
        app, "POST", "/v1/completions", json={"prompt": "id:", "max_tokens": 10, "guided_regex": "[ab]{3}"}
    )
    choice = regex.json()["choices"][0]
    assert re.fullmatch("[ab]{3}", choice["text"]) and choice["finish_reason"] == "stop"
    body = {"messages": USER, "max_tokens": 10, "guided_choice": ["yes", "no"]}
    answer = call(app, "POST", "/v1/chat/completions", json=body).json()["choices"][0]["message"]["content"]
    assert answer in ("yes", "no")


def test_logprobs_plain_and_streamed(app: Any) -> None:
    body = {"messages": USER, "max_tokens": 4, "ignore_eos": True, "logprobs": True, "top_logprobs": 2}
    body |= {"temperature": 0}
    choice = call(app, "POST", "/v1/chat/completions", json=body).json()["choices"][0]
    content = choice["logprobs"]["content"]
    assert len(content) == 4 and "".join(e["token"] for e in content) == choice["message"]["content"]
    for entry in content:
        assert entry["logprob"] <= 0 and len(entry["top_logprobs"]) == 2
        assert bytes(entry["bytes"]).decode(errors="replace") == entry["token"]
    chunks = sse_events(call(app, "POST", "/v1/chat/completions", json=body | {"stream": True}))
    streamed = [e for c in chunks for e in (c["choices"][0]["logprobs"] or {"content": []})["content"]]
    assert streamed == content
    body = {
        "prompt": "Once",
        "max_tokens": 4,
        "ignore_eos": True,
        "logprobs": 1,
        "seed": 5,
        "temperature": 0.7,
    }
    plain = call(app, "POST", "/v1/completions", json=body).json()["choices"][0]
    events = sse_events(call(app, "POST", "/v1/completions", json=body | {"stream": True}))
    tokens = [t for e in events for t in e["choices"][0]["logprobs"]["tokens"]]
    offsets = [t for e in events for t in e["choices"][0]["logprobs"]["text_offset"]]
    assert tokens == plain["logprobs"]["tokens"] and offsets == plain["logprobs"]["text_offset"]
    # `logprobs: 1`: the best token and the sampled one (the same one where it was the best), as vLLM lists them.
    first = plain["logprobs"]["top_logprobs"][0]
    assert offsets[0] == 0 and 1 <= len(first) <= 2
    assert first[tokens[0]] == plain["logprobs"]["token_logprobs"][0]
    assert_error(call(app, "POST", "/v1/chat/completions", json={"messages": USER, "top_logprobs": 2}), 400)


# -- errors ---------------------------------------------------------------------------------------------------


def test_error_bodies_then_a_normal_request_still_works(app: Any, engine: AsyncEngine) -> None:
    chat = "/v1/chat/completions"
    bad_json = call(app, "POST", chat, content=b"{nope", headers=AUTH | {"content-type": "application/json"})
    assert_error(bad_json, 400, "not valid JSON")
    assert (
        assert_error(call(app, "POST", chat, json={"model": "tiny"}), 400, "messages")["param"] == "messages"
    )
    bad_type = call(app, "POST", chat, json={"messages": USER, "temperature": "hot"})
    assert assert_error(bad_type, 400)["param"] == "temperature"
    assert_error(call(app, "POST", chat, json={"messages": USER, "top_p": 3}), 400, "top_p")
    assert_error(
        call(app, "POST", chat, json={"messages": USER}, headers={"Authorization": "Bearer no"}), 401
    )
    unknown = assert_error(call(app, "POST", chat, json={"model": "gpt-9", "messages": USER}), 404, "gpt-9")
    assert unknown["code"] == "model_not_found"
    too_long = call(app, "POST", "/v1/completions", json={"prompt": list(range(100, 2200)), "max_tokens": 5})
    assert_error(too_long, 400, "2100", str(KV_CACHE_TOKENS))
    schema = {"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}, "required": ["a"]}
    response_format = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    for stream in (False, True):
        body = {"messages": USER, "max_tokens": 5, "response_format": response_format, "stream": stream}
        assert_error(call(app, "POST", chat, json=body), 400, "$ref", "#/properties/a")
    two = {"messages": USER, "guided_regex": "a", "guided_choice": ["b"]}
    assert_error(call(app, "POST", chat, json=two), 400, "at most one")
    assert_error(call(app, "GET", "/v1/nothing-here"), 404)
    ok = call(app, "POST", chat, json={"messages": USER, "max_tokens": 3})
    assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["content"] is not None
    wait_idle(engine)


# -- the official SDK against uvicorn -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server_url(app: Any) -> Iterator[str]:
    with serve(app) as url:
        yield url


def test_openai_sdk_plain_streamed_and_json_schema(server_url: str) -> None:
    client = openai.OpenAI(base_url=f"{server_url}/v1", api_key=KEY, max_retries=0)
    plain = client.chat.completions.create(model="tiny", messages=USER, max_tokens=5, seed=1, temperature=0.5)
    assert plain.id.startswith("chatcmpl-") and plain.choices[0].message.refusal is None
    usage = plain.usage
    assert usage is not None and 1 <= usage.completion_tokens <= 5 and usage.prompt_tokens > 0
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens

    stream = client.chat.completions.create(
        model="tiny",
        messages=USER,
        max_tokens=5,
        seed=1,
        temperature=0.5,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == plain.choices[0].message.content
    assert chunks[-1].usage is not None and chunks[-1].usage.total_tokens == plain.usage.total_tokens

    schema = {
        "type": "object",
        "properties": {"n": {"type": "integer"}},
        "required": ["n"],
        "additionalProperties": False,
    }
    shaped = client.chat.completions.create(
        model="tiny",
        messages=USER,
        max_tokens=12,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "num", "schema": schema, "strict": True},
        },
    )
    text = shaped.choices[0].message.content or ""
    if shaped.choices[0].finish_reason == "stop":
        value = json.loads(text)
        assert set(value) == {"n"} and isinstance(value["n"], int)
    else:  # random weights may run out of tokens: what there is must still be a prefix of such an object
        assert re.fullmatch(r'\{("(n("(:(-?\d*)?)?)?)?)?', text), text

    regex = client.chat.completions.create(
        model="tiny", messages=USER, max_tokens=10, extra_body={"guided_regex": "[0-9]{2}-[xy]"}
    )
    assert re.fullmatch("[0-9]{2}-[xy]", regex.choices[0].message.content or "")

    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="other", messages=USER, max_tokens=2)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{server_url}/v1", api_key="bad", max_retries=0).models.list()


def test_client_disconnect_frees_the_kv_blocks(server_url: str, engine: AsyncEngine) -> None:
    body = {"model": "tiny", "prompt": "count", "max_tokens": 1000, "ignore_eos": True, "stream": True}
    aborted = engine.engine.stats().num_requests_aborted
    with httpx.Client(base_url=server_url, headers=AUTH, timeout=30) as client:
        for _ in range(3):
            with client.stream("POST", "/v1/completions", json=body) as response:
                assert response.status_code == 200
                lines = response.iter_lines()
                assert next(lines).startswith("data: ")  # mid-stream: then hang up
    wait_idle(engine)
    assert engine.engine.stats().num_requests_aborted == aborted + 3
