"""Helpers shared by the server tests: ASGI calls, SSE parsing, the OpenAI error shape, tiny engines."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx

from structgen.config import CacheConfig, EngineConfig, SchedulerConfig
from structgen.engine.async_engine import AsyncEngine
from structgen.engine.llm_engine import LLMEngine
from structgen.structured import StructuredOutputConfig

KEY = "test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
TINY_KV_CACHE_TOKENS = 2048
USER = [{"role": "user", "content": "Give me a number."}]
# The arguments of the weather tools the tool-calling tests (chat and Responses) offer SmolLM2.
CITY = {
    "type": "object",
    "properties": {"city": {"type": "string"}},
    "required": ["city"],
    "additionalProperties": False,
}
FORECAST = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "days"],
    "additionalProperties": False,
}


def tiny_engine(
    *,
    max_num_seqs: int = 256,
    structured: StructuredOutputConfig | None = None,
    logprobs_mode: str = "raw_logprobs",
) -> AsyncEngine:
    config = EngineConfig(
        model="tiny",
        device="cpu",
        cache=CacheConfig(kv_cache_tokens=TINY_KV_CACHE_TOKENS),
        scheduler=SchedulerConfig(max_num_seqs=max_num_seqs),
        structured=structured,
        logprobs_mode=logprobs_mode,
    )
    return AsyncEngine(LLMEngine(config))


def tiny_thinking_engine(reasoning_parser: str, *, thinking_token_budget: int | None = None) -> AsyncEngine:
    """`tiny-thinking` (random weights, `<think>` / `</think>` tokens, a Qwen3-style template) with a reasoning
    parser; llguidance alone, as building every backend for its 100k vocabulary takes long on a shared CPU."""
    config = EngineConfig(
        model="tiny-thinking",
        device="cpu",
        cache=CacheConfig(kv_cache_tokens=TINY_KV_CACHE_TOKENS),
        structured=StructuredOutputConfig(backend="llguidance"),
        reasoning_parser=reasoning_parser,
        thinking_token_budget=thinking_token_budget,
    )
    return AsyncEngine(LLMEngine(config))


def call(
    app: Any, method: str, path: str, *, headers: dict[str, str] | None = AUTH, **kwargs: Any
) -> httpx.Response:
    async def main() -> httpx.Response:
        transport = httpx.ASGITransport(app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return await client.request(method, path, headers=headers, **kwargs)

    return asyncio.run(main())


def sse_events(response: httpx.Response) -> list[Any]:
    """The decoded `data:` payloads of an SSE body; asserts the framing and that `[DONE]` ends it."""
    assert response.headers["content-type"].startswith("text/event-stream")
    blocks = [b for b in response.text.split("\n\n") if b]
    assert all(b.startswith("data: ") for b in blocks)
    assert blocks[-1] == "data: [DONE]"
    return [json.loads(b.removeprefix("data: ")) for b in blocks[:-1]]


def assert_error(response: httpx.Response, status: int, *words: str) -> dict[str, Any]:
    assert response.status_code == status, response.text
    return assert_error_body(response.json(), *words)


def assert_error_body(body: dict[str, Any], *words: str) -> dict[str, Any]:
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    message = body["error"]["message"]
    assert "Traceback" not in message
    for word in words:
        assert word in message, message
    return body["error"]


# The Responses stream's event sequence (event types joined by spaces) for a text part and a function call.
TEXT_EVENTS = (
    r"response\.output_item\.added response\.content_part\.added (response\.output_text\.delta )+"
    r"response\.output_text\.done response\.content_part\.done response\.output_item\.done"
)
CALL_EVENTS = (
    r"response\.output_item\.added (response\.function_call_arguments\.delta )+"
    r"response\.function_call_arguments\.done response\.output_item\.done"
)


async def refused_generate(*args: Any, **kwargs: Any) -> Any:
    """A stand-in for `AsyncEngine.generate` refusing a request once it runs: it raises when first awaited, as
    the engine's own refusals do."""
    raise ValueError("the engine refused it")
    yield  # an async generator, as `generate` is
