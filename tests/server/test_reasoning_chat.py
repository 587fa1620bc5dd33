"""Chat completions from a reasoning model (`serve --reasoning-parser`), on `tiny-thinking`: the reasoning in
`message.reasoning` / `reasoning_content` only, the answer in `content` valid under its schema after a reasoning
budget, streamed deltas (and logprobs) that add up to the plain answer, tool calls parsed from the answer alone,
`chat_template_kwargs` (`enable_thinking: false`; reserved names refused), `include_reasoning: false`, usage's
`reasoning_tokens`, the `openai` SDK reading it all, and `/v1/completions` left without a reasoning phase.

The random-weight model never writes `</think>` by itself, so the budget is what ends every reasoning here. The
deepseek_r1 parser reasons from the first output token (the template opens no block); qwen3's leaves the choice to
the model, whose first token under a schema's mask is `{` or `<think>`."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import jsonschema
import openai
import pytest
from live_server import serve, wait_idle
from server_helpers import CITY, KEY, USER, assert_error, call, sse_events, tiny_thinking_engine

from structgen.engine.async_engine import AsyncEngine
from structgen.server import build_app

CHAT = "/v1/chat/completions"
BUDGET = 12
SCHEMA = {
    "type": "object",
    "properties": {"n": {"type": "integer"}, "ok": {"type": "boolean"}},
    "required": ["n", "ok"],
    "additionalProperties": False,
}
FORMAT = {"type": "json_schema", "json_schema": {"name": "out", "schema": SCHEMA, "strict": True}}
SHAPED = {
    "messages": USER,
    "response_format": FORMAT,
    "thinking_token_budget": BUDGET,
    "max_tokens": 64,
    "temperature": 1.0,
}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": CITY, "strict": True}}]
MARKERS = ("<think>", "</think>")
NO_THINKING = {"enable_thinking": False}


def chat(thinking_app: Any, body: dict[str, Any]) -> dict[str, Any]:
    response = call(thinking_app, "POST", CHAT, json=body)
    assert response.status_code == 200, response.text
    return response.json()


def streamed(thinking_app: Any, body: dict[str, Any]) -> list[dict[str, Any]]:
    options = {"stream": True, "stream_options": {"include_usage": True}}
    return sse_events(call(thinking_app, "POST", CHAT, json=body | options))


def assert_no_markers(*texts: str | None) -> None:
    for text in texts:
        assert not any(marker in (text or "") for marker in MARKERS), text


def joined(chunks: list[dict[str, Any]], n: int) -> list[dict[str, Any]]:
    """Per choice: the concatenated reasoning, reasoning_content and content deltas, the tool-call deltas, the
    finish reason, which kind of delta came in which order, and the logprob entries (and how many came on
    chunks without content or a finish: the reasoning's)."""
    choices: list[dict[str, Any]] = [
        {
            "reasoning": None,
            "reasoning_content": None,
            "content": "",
            "calls": [],
            "order": [],
            "logprobs": [],
        }
        | {"thinking_logprobs": 0}
        for _ in range(n)
    ]
    for chunk in chunks:
        for choice in chunk["choices"]:
            delta, out = choice["delta"], choices[choice["index"]]
            entries = (choice.get("logprobs") or {}).get("content") or []
            out["logprobs"] += entries
            if not delta.get("content") and choice.get("finish_reason") is None:
                out["thinking_logprobs"] += len(entries)
            assert_no_markers(delta.get("content"), delta.get("reasoning"))
            if "reasoning" in delta:
                assert delta["reasoning"] and delta["reasoning_content"] == delta["reasoning"]
                assert not delta.get("content") and not delta.get("tool_calls")  # a chunk of its own
                for key in ("reasoning", "reasoning_content"):
                    out[key] = (out[key] or "") + delta[key]
                out["order"].append("reasoning")
            if delta.get("content"):
                out["content"] += delta["content"]
                out["order"].append("content")
            if delta.get("tool_calls"):
                out["calls"] += delta["tool_calls"]
                out["order"].append("tool_calls")
            if choice.get("finish_reason") is not None:
                out["finish_reason"] = choice["finish_reason"]
    return choices


def reasoning_tokens(body: dict[str, Any]) -> int:
    return int(body["usage"]["completion_tokens_details"]["reasoning_tokens"])


@pytest.mark.parametrize("seed", [3, 5, 8])
def test_the_answer_validates_after_the_budget_and_the_reasoning_stays_apart(
    thinking_app: Any, seed: int
) -> None:
    body = chat(thinking_app, SHAPED | {"n": 2, "seed": seed})
    for choice in body["choices"]:
        message = choice["message"]
        jsonschema.validate(json.loads(message["content"]), SCHEMA)
        assert choice["finish_reason"] == "stop" and choice["structured"]["valid"] is True
        # The budget ends the reasoning (the random model never closes it): BUDGET tokens of it, markers apart.
        assert isinstance(message["reasoning"], str) and message["reasoning"]
        assert message["reasoning_content"] == message["reasoning"]
        assert message["reasoning"] not in message["content"]
        assert_no_markers(message["content"], message["reasoning"])
    # The reasoning and the forced `</think>` of each choice; the rest of the completion tokens are the answer's.
    assert reasoning_tokens(body) == 2 * (BUDGET + 1)
    assert body["usage"]["completion_tokens"] > reasoning_tokens(body)


def test_streamed_deltas_add_up_to_the_plain_answer(thinking_app: Any) -> None:
    body = SHAPED | {"n": 2, "seed": 21, "logprobs": True}
    plain = chat(thinking_app, body)
    chunks = streamed(thinking_app, body)
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == plain["usage"]
    for streamed_choice, choice in zip(joined(chunks[:-1], 2), plain["choices"], strict=True):
        message = choice["message"]
        assert streamed_choice["reasoning"] == message["reasoning"]
        assert streamed_choice["reasoning_content"] == message["reasoning_content"]
        assert streamed_choice["content"] == message["content"]
        assert streamed_choice["finish_reason"] == choice["finish_reason"]
        # All of the reasoning comes before any of the answer.
        order = streamed_choice["order"]
        assert order[0] == "reasoning" and "reasoning" not in order[order.index("content") :]
        # Every token's logprob once, in order: the reasoning's (and `</think>`'s) apart from the answer's.
        assert streamed_choice["logprobs"] == choice["logprobs"]["content"]
        assert streamed_choice["thinking_logprobs"] == BUDGET + 1


def test_tool_calls_come_from_the_answer_after_the_reasoning(thinking_app: Any) -> None:
    body = {
        "messages": [{"role": "user", "content": "What is the weather in Oslo?"}],
        "tools": TOOLS,
        "tool_choice": "required",
        "thinking_token_budget": 8,
        "max_tokens": 80,
        "seed": 4,
        "temperature": 1.0,
    }
    # The tools make the prompt long enough to hit the prefix cache from the second request on, which changes
    # the logits' rounding and so a seeded sample of this flat random model: the first request only warms it.
    chat(thinking_app, body)
    plain = chat(thinking_app, body)
    (choice,) = plain["choices"]
    message = choice["message"]
    assert choice["finish_reason"] == "tool_calls" and message["tool_calls"]
    for tool_call in message["tool_calls"]:
        assert tool_call["function"]["name"] == "get_weather"
        jsonschema.validate(json.loads(tool_call["function"]["arguments"]), CITY)
        assert_no_markers(tool_call["function"]["arguments"])
    assert message["reasoning"] and message["reasoning_content"] == message["reasoning"]
    assert_no_markers(message["content"], message["reasoning"])
    assert reasoning_tokens(plain) == 8 + 1

    chunks = streamed(thinking_app, body)
    (streamed_choice,) = joined(chunks[:-1], 1)
    assert streamed_choice["reasoning"] == message["reasoning"]
    assert streamed_choice["finish_reason"] == "tool_calls"
    # The reasoning passed the tool-call parser untouched; the calls it parsed are the plain answer's.
    order = streamed_choice["order"]
    assert order[0] == "reasoning" and "reasoning" not in order[order.index("tool_calls") :]
    names = [c["function"]["name"] for c in streamed_choice["calls"] if c.get("function", {}).get("name")]
    arguments = "".join(c.get("function", {}).get("arguments") or "" for c in streamed_choice["calls"])
    assert names == [c["function"]["name"] for c in message["tool_calls"]]
    assert arguments == "".join(c["function"]["arguments"] for c in message["tool_calls"])


def test_enable_thinking_false_answers_without_reasoning(thinking_app: Any) -> None:
    body = SHAPED | {"seed": 2, "chat_template_kwargs": NO_THINKING}
    plain = chat(thinking_app, body)
    (choice,) = plain["choices"]
    message = choice["message"]
    assert message["reasoning"] is None and message["reasoning_content"] is None
    jsonschema.validate(json.loads(message["content"]), SCHEMA)
    assert_no_markers(message["content"])
    assert reasoning_tokens(plain) == 0

    chunks = streamed(thinking_app, body)
    assert not any("reasoning" in c["delta"] for chunk in chunks[:-1] for c in chunk["choices"])
    assert joined(chunks[:-1], 1)[0]["content"] == message["content"]


def test_include_reasoning_false_leaves_the_reasoning_out(thinking_app: Any) -> None:
    body = SHAPED | {"seed": 9}
    full = chat(thinking_app, body)
    lean = chat(thinking_app, body | {"include_reasoning": False})
    message = lean["choices"][0]["message"]
    assert message["reasoning"] is None and message["reasoning_content"] is None
    assert message["content"] == full["choices"][0]["message"]["content"]
    # The model still reasoned: the tokens count.
    assert reasoning_tokens(lean) == reasoning_tokens(full) == BUDGET + 1

    chunks = streamed(thinking_app, body | {"include_reasoning": False})
    assert not any("reasoning" in c["delta"] for chunk in chunks[:-1] for c in chunk["choices"])
    assert joined(chunks[:-1], 1)[0]["content"] == message["content"]


def test_earlier_reasoning_in_the_history_is_accepted_and_left_to_the_template(thinking_app: Any) -> None:
    turns = [
        *USER,
        {"role": "assistant", "content": '{"n": 1, "ok": true}'},
        {"role": "user", "content": "More."},
    ]
    alike = [dict(turns[1], reasoning_content="Let me count."), dict(turns[1], reasoning="Let me count.")]
    counts = {
        call(thinking_app, "POST", "/tokenize", json={"messages": [turns[0], turn, turns[2]]}).json()["count"]
        for turn in [turns[1], *alike]
    }
    assert len(counts) == 1  # Qwen3's template drops the reasoning of turns before the last user message
    answer = chat(thinking_app, {"messages": [turns[0], alike[0], turns[2]], "max_tokens": 4})
    assert answer["choices"][0]["message"]["reasoning"] is not None


def test_tokenize_takes_the_chat_template_kwargs(thinking_app: Any) -> None:
    tokenizer_of = thinking_app.state.server.tokenizer
    counted = call(
        thinking_app, "POST", "/tokenize", json={"messages": USER, "chat_template_kwargs": NO_THINKING}
    )
    tokens = counted.json()["tokens"]
    assert tokenizer_of.decode(tokens, skip_special_tokens=False).endswith("<think>\n\n</think>\n\n")
    answer = chat(thinking_app, {"messages": USER, "chat_template_kwargs": NO_THINKING, "max_tokens": 2})
    assert answer["usage"]["prompt_tokens"] == counted.json()["count"]
    refused = call(
        thinking_app, "POST", "/tokenize", json={"prompt": "hi", "chat_template_kwargs": NO_THINKING}
    )
    assert_error(refused, 400, "applies to messages")


@pytest.mark.parametrize("key", ["messages", "add_generation_prompt", "tools", "bos_token"])
def test_chat_template_kwargs_cannot_replace_the_templates_own_variables(thinking_app: Any, key: str) -> None:
    response = call(thinking_app, "POST", CHAT, json={"messages": USER, "chat_template_kwargs": {key: []}})
    error = assert_error(response, 400, "chat_template_kwargs", repr(key))
    assert error["param"] == "chat_template_kwargs"


@pytest.mark.parametrize("budget", [-1, "8", 1.5])
def test_a_bad_thinking_token_budget_is_a_400_naming_it(thinking_app: Any, budget: Any) -> None:
    response = call(thinking_app, "POST", CHAT, json={"messages": USER, "thinking_token_budget": budget})
    assert assert_error(response, 400)["param"] == "thinking_token_budget"


def test_text_completions_have_no_reasoning_phase(thinking_app: Any) -> None:
    body = {"prompt": "Once upon", "max_tokens": 6, "ignore_eos": True, "seed": 1, "temperature": 1.0}
    plain = call(thinking_app, "POST", "/v1/completions", json=body).json()
    (choice,) = plain["choices"]
    # Every token is the text's (under a reasoning phase the first ones would all be reasoning).
    assert choice["text"] and "reasoning" not in choice
    assert plain["usage"]["completion_tokens"] == 6
    assert plain["usage"]["completion_tokens_details"] == {"reasoning_tokens": 0}
    # A grammar applies from the first token.
    regex = {"prompt": "digits", "max_tokens": 8, "structured_outputs": {"regex": "[0-9]{3}"}}
    constrained = call(thinking_app, "POST", "/v1/completions", json=regex).json()
    assert re.fullmatch(r"[0-9]{3}", constrained["choices"][0]["text"])
    chunks = sse_events(call(thinking_app, "POST", "/v1/completions", json=body | {"stream": True}))
    assert "".join(c["choices"][0]["text"] for c in chunks) == choice["text"]


def test_the_openai_sdk_reads_the_reasoning(thinking_engine: AsyncEngine, thinking_app: Any) -> None:
    options: dict[str, Any] = {
        "model": "tiny-thinking",
        "messages": USER,
        "response_format": FORMAT,
        "max_tokens": 48,
        "temperature": 0,
        "extra_body": {"thinking_token_budget": 8},
    }
    with serve(thinking_app) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)
        plain = client.chat.completions.create(**options)
        chunks = list(
            client.chat.completions.create(**options, stream=True, stream_options={"include_usage": True})
        )
    wait_idle(thinking_engine)
    message = plain.choices[0].message
    reasoning = getattr(message, "reasoning", None)  # an extra field to the SDK, kept as sent
    assert reasoning and getattr(message, "reasoning_content", None) == reasoning
    jsonschema.validate(json.loads(message.content or ""), SCHEMA)
    assert plain.usage is not None and plain.usage.completion_tokens_details is not None
    assert plain.usage.completion_tokens_details.reasoning_tokens == 9
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == reasoning
    assert "".join(d.content or "" for d in deltas) == message.content
    assert chunks[-1].usage == plain.usage


# -- qwen3: the model opens the block itself, or answers at once ------------------------------------------------


@pytest.fixture(scope="module")
def qwen3_app() -> Iterator[Any]:
    async_engine = tiny_thinking_engine("qwen3", thinking_token_budget=BUDGET)  # the server's default budget
    yield build_app(async_engine, async_engine.engine.tokenizer, model_name="tiny-thinking")
    async_engine.shutdown()


@pytest.mark.parametrize("kwargs", [None, NO_THINKING])
def test_qwen3_reasons_only_when_the_model_opens_the_block(qwen3_app: Any, kwargs: Any) -> None:
    body = {key: value for key, value in SHAPED.items() if key != "thinking_token_budget"}
    plain = chat(qwen3_app, body | {"n": 4, "seed": 6, "chat_template_kwargs": kwargs})
    opened = 0
    for choice in plain["choices"]:
        message = choice["message"]
        jsonschema.validate(json.loads(message["content"]), SCHEMA)
        assert_no_markers(message["content"], message["reasoning"])
        assert message["reasoning_content"] == message["reasoning"]
        opened += message["reasoning"] is not None
    # Under the schema's mask the first token is `{` or `<think>`; a block the model opens runs to the server's
    # budget (`<think>`, BUDGET tokens, the forced `</think>`). With thinking off the template closed it already.
    assert reasoning_tokens(plain) == opened * (BUDGET + 2)
    if kwargs == NO_THINKING:
        assert opened == 0
