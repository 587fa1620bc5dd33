"""The client with reasoning models, against scripted servers: the reasoning a server reports beside the answer
(`message.reasoning` or `reasoning_content`, streamed in `delta`s) comes back next to the parsed value, the
reasoning options travel as request fields, and `parse` / `stream_parse` are unchanged."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

import pytest
from client_helpers import Server, chunk, completion, run_async, sse
from pydantic import BaseModel, Field

from structgen.client import (
    MISSING,
    AsyncClient,
    Client,
    OutputValidationError,
    Parsed,
    TruncatedOutputError,
)

ANSWER = '{"name":"Oslo","population":700000}'


class City(BaseModel):
    name: str
    population: int


OSLO = City(name="Oslo", population=700000)


def with_usage(reply: dict[str, Any], reasoning_tokens: int) -> dict[str, Any]:
    details = {"reasoning_tokens": reasoning_tokens}
    reply["usage"] = {"prompt_tokens": 9, "completion_tokens": 40, "completion_tokens_details": details}
    return reply


def thinking(text: str, key: str = "reasoning") -> dict[str, Any]:
    return {"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {key: text}}]}


def test_parse_with_reasoning_returns_the_value_and_its_reasoning() -> None:
    server = Server(
        with_usage(
            completion(ANSWER, reasoning="Oslo is the capital.", reasoning_content="Oslo is the capital."), 7
        ),
        completion(ANSWER, reasoning_content="Older vLLM names it so."),
        completion(ANSWER),  # a server (or a request) without reasoning
    )
    client = server.client(model="m")
    first = client.parse_with_reasoning(City, prompt="Oslo?", thinking_token_budget=64)
    assert first == Parsed(OSLO, "Oslo is the capital.", 7)
    assert isinstance(first.value, City) and first.done
    assert client.parse_with_reasoning(City, prompt="Oslo?").reasoning == "Older vLLM names it so."
    assert client.parse_with_reasoning(City, prompt="Oslo?") == Parsed(OSLO, None, None)


def test_reasoning_options_are_sent_as_request_fields() -> None:
    server = Server(completion(ANSWER), completion(ANSWER))
    client = server.client(model="m")
    client.parse_with_reasoning(
        City,
        prompt="Oslo?",
        thinking_token_budget=128,
        chat_template_kwargs={"enable_thinking": False},
        include_reasoning=False,
    )
    assert client.parse(City, prompt="Oslo?", thinking_token_budget=None, max_tokens=256) == OSLO
    first, second = server.bodies()
    assert first["thinking_token_budget"] == 128 and first["include_reasoning"] is False
    assert first["chat_template_kwargs"] == {"enable_thinking": False}
    assert "thinking_token_budget" not in second  # None means "not sent", as for every field


def test_parse_ignores_the_reasoning_and_n_gives_one_parsed_per_choice() -> None:
    reply = completion(ANSWER, ANSWER.replace("700000", "1"), reasoning="r")
    server = Server(completion(ANSWER, reasoning="thought"), with_usage(reply, 12))
    client = server.client(model="m")
    assert client.parse(City, prompt="x") == OSLO
    both = client.parse_with_reasoning(City, prompt="x", n=2)
    assert [p.value.population for p in both] == [700000, 1]
    assert all(p.reasoning == "r" and p.reasoning_tokens == 12 for p in both)


def test_output_errors_carry_the_reasoning() -> None:
    server = Server(
        completion(None, finish_reason="length", reasoning="on and on"),
        completion('{"name":"Oslo"}', reasoning="short"),
        completion('{"name":"Os', finish_reason="length"),
    )
    client = server.client(model="m")
    with pytest.raises(TruncatedOutputError, match="thinking_token_budget") as truncated:
        client.parse_with_reasoning(City, prompt="x")
    assert truncated.value.reasoning == "on and on" and truncated.value.raw_text is None
    with pytest.raises(OutputValidationError) as invalid:
        client.parse(City, prompt="x")
    assert invalid.value.reasoning == "short" and invalid.value.errors
    with pytest.raises(TruncatedOutputError) as plain:
        client.parse(City, prompt="x")
    assert plain.value.reasoning is None and "thinking_token_budget" not in str(plain.value)


STREAM = [
    {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]},
    thinking("Oslo is "),
    thinking("the capital", key="reasoning_content"),
    thinking(""),
    chunk('{"name":"Os'),
    chunk('lo","population":7'),
    chunk("00000}"),
    chunk(None, "stop"),
    with_usage({"object": "chat.completion.chunk", "choices": []}, 5),
    "[DONE]",
]


def test_stream_parse_with_reasoning_yields_snapshots_then_the_parsed_value() -> None:
    server = Server(sse(*STREAM), sse(*STREAM))
    client = server.client(model="m")
    items = list(client.stream_parse_with_reasoning(City, prompt="x", stream_options={"include_usage": True}))
    assert items == [
        Parsed(MISSING, "Oslo is ", None, done=False),
        Parsed(MISSING, "Oslo is the capital", None, done=False),
        Parsed({"name": "Os"}, "Oslo is the capital", None, done=False),
        Parsed({"name": "Oslo"}, "Oslo is the capital", None, done=False),
        Parsed({"name": "Oslo", "population": 700000}, "Oslo is the capital", None, done=False),
        Parsed(OSLO, "Oslo is the capital", 5),  # the usage chunk came last
    ]
    assert server.bodies()[0]["stream"] is True
    # The plain stream skips the reasoning deltas: only partial values, then the value.
    assert list(client.stream_parse(City, prompt="x")) == [*(item.value for item in items[2:-1]), OSLO]


def test_a_snapshot_is_the_callers_to_keep() -> None:
    stream = [chunk('{"name":"Os'), thinking("late"), chunk('lo","population":1}'), chunk(None, "stop")]
    items = list(Server(sse(*stream)).client(model="m").stream_parse_with_reasoning(City, prompt="x"))
    items[0].value["name"] = "changed"
    assert [item.value for item in items[:2]] == [{"name": "changed"}, {"name": "Os"}]
    assert items[-1] == Parsed(City(name="Oslo", population=1), "late", None)


def test_async_reasoning() -> None:
    async def both(client: AsyncClient) -> Any:
        parsed = await client.parse_with_reasoning(City, prompt="x")
        streamed = [item async for item in client.stream_parse_with_reasoning(City, prompt="x")]
        return parsed, streamed[-1]

    server = Server(completion(ANSWER, reasoning="thought"), sse(*STREAM))
    parsed, last = run_async(both, server, model="m")
    assert parsed == Parsed(OSLO, "thought", None)
    assert last == Parsed(OSLO, "Oslo is the capital", 5)


# -- a real server on `tiny-thinking` ---------------------------------------------------------------------------

BUDGET = 6


@pytest.fixture(scope="module")
def thinking_url() -> Iterator[str]:
    """A server with DeepSeek-R1's parser on the random-weight `tiny-thinking`: its output reasons from the
    first token and never closes `</think>` itself, so the reasoning ends at the budget."""
    from live_server import serve, wait_idle

    from structgen.config import CacheConfig, EngineConfig
    from structgen.engine.async_engine import AsyncEngine
    from structgen.engine.llm_engine import LLMEngine
    from structgen.server import build_app

    config = EngineConfig(
        model="tiny-thinking",
        device="cpu",
        cache=CacheConfig(kv_cache_tokens=2048),
        reasoning_parser="deepseek_r1",
    )
    engine = AsyncEngine(LLMEngine(config))
    try:
        with serve(build_app(engine, engine.engine.tokenizer, model_name="tiny-thinking")) as url:
            yield url
        wait_idle(engine)
    finally:
        engine.shutdown()


class Rank(BaseModel):
    city: str = Field(max_length=12)
    rank: int


LIVE: dict[str, Any] = {"prompt": "Which city is first?", "temperature": 0, "max_tokens": 64}


def test_live_reasoning_comes_back_beside_the_value(thinking_url: str) -> None:
    with Client(base_url=thinking_url) as client:
        parsed = client.parse_with_reasoning(Rank, thinking_token_budget=BUDGET, **LIVE)
        streamed = list(client.stream_parse_with_reasoning(Rank, thinking_token_budget=BUDGET, **LIVE))
        assert client.parse(Rank, thinking_token_budget=BUDGET, **LIVE) == parsed.value
        plain = client.parse_with_reasoning(Rank, chat_template_kwargs={"enable_thinking": False}, **LIVE)
    assert isinstance(parsed.value, Rank) and parsed.reasoning and parsed.done
    assert "<think>" not in parsed.reasoning and "</think>" not in parsed.reasoning
    assert parsed.reasoning_tokens in (BUDGET + 1, BUDGET + 2)  # the budget, `</think>`, perhaps `<think>`
    # The stream: reasoning snapshots that only grow, then the same value and reasoning (no usage: not asked for).
    *snapshots, last = streamed
    assert snapshots and all(not s.done for s in snapshots) and snapshots[0].value is MISSING
    texts = [s.reasoning or "" for s in snapshots]
    assert all(later.startswith(earlier) for earlier, later in itertools.pairwise(texts))
    assert last == Parsed(parsed.value, parsed.reasoning, None)
    assert plain.reasoning is None and plain.reasoning_tokens == 0 and isinstance(plain.value, Rank)
