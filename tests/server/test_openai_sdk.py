"""The official `openai` SDK against a real uvicorn serving the default SmolLM2-135M model: plain and streamed
chat, `parse()` into pydantic models, json_schema / json_object, vLLM extras through `extra_body`, seeds, `n`,
usage, and KV blocks all free after 20 streaming clients hang up mid-stream."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from enum import Enum
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from live_server import serve, wait_idle
from pydantic import BaseModel, Field

from structgen.engine.async_engine import AsyncEngine
from structgen.server import build_app

pytestmark = pytest.mark.slow
MODEL = "smollm2-135m"
YES_NO = "Reply with one word: yes or no. Is water wet?"  # SmolLM2 answers in 3 tokens


@pytest.fixture(scope="module")
def server_url(smollm2_engine: AsyncEngine) -> Iterator[str]:
    app = build_app(smollm2_engine, smollm2_engine.engine.tokenizer, model_name=MODEL)
    with serve(app) as url:
        yield url
    wait_idle(smollm2_engine)


@pytest.fixture(scope="module")
def client(server_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server_url}/v1", api_key="unused", max_retries=0)


def ask(content: str) -> list[Any]:
    return [{"role": "user", "content": content}]


class Color(str, Enum):
    red = "red"
    green = "green"
    blue = "blue"


class Pet(BaseModel):
    name: str = Field(max_length=12)
    color: Color


class Owner(BaseModel):
    name: str = Field(max_length=12)
    age: int
    pet: Pet


class Tagged(BaseModel):
    tags: list[Color] = Field(max_length=3)
    nickname: str | None = Field(max_length=10)


class Point(BaseModel):
    x: int
    y: int


class Segment(BaseModel):
    start: Point
    end: Point
    label: str | None = Field(max_length=8)


def test_plain_and_streamed_chat_agree_for_a_seed_with_right_usage(
    client: openai.OpenAI, smollm2_engine: AsyncEngine
) -> None:
    messages = ask("Name a fruit.")
    kwargs: dict[str, Any] = {
        "model": MODEL,
        "messages": messages,
        "max_tokens": 24,
        "seed": 7,
        "temperature": 0.8,
    }
    plain = client.chat.completions.create(**kwargs)
    text = plain.choices[0].message.content
    assert text and plain.choices[0].message.tool_calls is None
    prompt_tokens = len(smollm2_engine.engine.tokenizer.encode_chat(messages))
    assert plain.usage is not None and plain.usage.prompt_tokens == prompt_tokens
    assert plain.usage.completion_tokens == len(
        smollm2_engine.engine.tokenizer.encode(text, add_special_tokens=False)
    ) + (plain.choices[0].finish_reason == "stop")  # the EOS that stopped it is generated too
    chunks = list(
        client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True})
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert chunks[-1].usage == plain.usage
    three = client.chat.completions.create(**kwargs | {"n": 3})
    assert [c.index for c in three.choices] == [0, 1, 2]
    assert three.choices[0].message.content == text  # sample 0 of a seeded request draws from the seed itself
    assert three.usage is not None and three.usage.prompt_tokens == prompt_tokens


@pytest.mark.parametrize("model", [Owner, Tagged, Segment])
def test_parse_returns_model_instances(client: openai.OpenAI, model: type[BaseModel]) -> None:
    completion = client.chat.completions.parse(
        model=MODEL,
        messages=ask(f"Describe one example {model.__name__} as JSON."),
        response_format=model,
        max_tokens=64,
        temperature=0,
    )
    choice = completion.choices[0]
    assert choice.finish_reason == "stop", choice.message.content
    assert isinstance(choice.message.parsed, model)


def test_json_schema_and_json_object(client: openai.OpenAI) -> None:
    schema = {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 15},
            "population": {"type": "integer", "minimum": 0},
            "coastal": {"type": "boolean"},
        },
        "required": ["city", "population", "coastal"],
        "additionalProperties": False,
    }
    response_format: Any = {
        "type": "json_schema",
        "json_schema": {"name": "city", "schema": schema, "strict": True},
    }
    for seed in (1,):
        shaped = client.chat.completions.create(
            model=MODEL,
            messages=ask("Tell me about Paris."),
            max_tokens=48,
            seed=seed,
            response_format=response_format,
        )
        assert shaped.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(shaped.choices[0].message.content or ""), schema)
    obj = client.chat.completions.create(
        model=MODEL,
        messages=ask("Reply with a JSON object with keys name and age."),
        max_tokens=48,
        temperature=0,
        response_format={"type": "json_object"},
    )
    assert obj.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(obj.choices[0].message.content or ""), dict)


def test_vllm_extras_through_extra_body(client: openai.OpenAI) -> None:
    def content(
        extra: dict[str, Any], max_tokens: int = 32, question: str = "Answer briefly: is the sky blue?"
    ) -> tuple[str, Any]:
        out = client.chat.completions.create(
            model=MODEL,
            messages=ask(question),
            max_tokens=max_tokens,
            temperature=0,
            extra_body=extra,
        )
        return out.choices[0].message.content or "", out

    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    text, _ = content({"guided_json": schema})
    jsonschema.validate(json.loads(text), schema)
    assert content({"guided_regex": "(yes|no), [a-z]{2,6}"})[0].split(", ")[0] in ("yes", "no")
    assert content({"guided_choice": ["yes", "no"]})[0] in ("yes", "no")
    grammar = 'start: "answer: " ANSWER\nANSWER: "yes" | "no"'
    assert content({"guided_grammar": grammar})[0] in ("answer: yes", "answer: no")
    assert content({"structured_outputs": {"choice": ["blue", "grey"]}})[0] in ("blue", "grey")
    sampled, _ = content({"top_k": 5, "min_p": 0.1, "repetition_penalty": 1.2, "seed": 3}, max_tokens=6)
    assert sampled
    _, short = content({}, max_tokens=12, question=YES_NO)
    _, forced = content({"min_tokens": 12}, max_tokens=12, question=YES_NO)
    assert short.choices[0].finish_reason == "stop" and short.usage.completion_tokens < 12
    assert forced.choices[0].finish_reason == "length" and forced.usage.completion_tokens == 12


def test_kv_blocks_free_after_20_streaming_clients_hang_up(
    server_url: str, smollm2_engine: AsyncEngine
) -> None:
    aborted = smollm2_engine.engine.stats().num_requests_aborted
    body = {"model": MODEL, "messages": ask("Count to one thousand."), "max_tokens": 2000, "ignore_eos": True}
    barrier = threading.Barrier(20)
    errors: list[BaseException] = []

    def hang_up() -> None:
        try:
            with (
                httpx.Client(base_url=server_url, timeout=60) as http,
                http.stream("POST", "/v1/chat/completions", json=body | {"stream": True}) as response,
            ):
                assert response.status_code == 200
                lines = (line for line in response.iter_lines() if line)
                for _ in range(3):  # the role chunk, then two content chunks: mid-stream
                    assert next(lines).startswith("data: ")
                barrier.wait(60)  # all 20 are streaming at once, then all hang up
        except BaseException as error:
            errors.append(error)

    threads = [threading.Thread(target=hang_up) for _ in range(20)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(90)
    assert not errors, errors
    wait_idle(smollm2_engine)
    stats = smollm2_engine.engine.stats()
    assert stats.num_requests_aborted == aborted + 20
    assert stats.kv_blocks_used == 0 and stats.kv_blocks_free == stats.kv_blocks_total
