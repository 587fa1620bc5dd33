"""Engine death, server side (issue 10, item 4), over real HTTP on `tiny`: once the step loop has crashed,
`/health` answers 503, a stream in flight ends with an error event and `[DONE]`, a plain request in flight and
every new request get a prompt 503 with an OpenAI error body, and nobody hangs.

The crash is injected into a second `AsyncEngine` over the shared `tiny` `LLMEngine` (seen through a proxy
whose `step` raises on demand, before touching the engine), so no second model is loaded; the requests the dead
loop left behind are aborted afterwards and the shared engine is handed back idle."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from live_server import serve, wait_idle
from reliability_helpers import AUTH, USER, assert_error, assert_error_body, keyed_app

from structgen.engine.async_engine import AsyncEngine

PROMPT_BODY = {"messages": USER, "max_tokens": 400, "ignore_eos": True}
PROMPT_TIMEOUT_S = 5.0


class CrashingEngine:
    """The shared `LLMEngine`, except that `step` raises once `crash` is set; remembers the requests added."""

    def __init__(self, engine: Any) -> None:
        self._engine = engine
        self.crash = threading.Event()
        self.request_ids: list[str] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    def add_request(self, request_id: str, *args: Any, **kwargs: Any) -> Any:
        self.request_ids.append(request_id)
        return self._engine.add_request(request_id, *args, **kwargs)

    def shutdown(self) -> None:
        """Nothing to stop: the shared engine outlives this test (its owner shuts it down)."""

    def step(self) -> Any:
        if self.crash.is_set():
            raise RuntimeError("injected step loop failure")
        return self._engine.step()


@pytest.fixture
def crashing(server_tiny_engine: AsyncEngine) -> Iterator[tuple[AsyncEngine, CrashingEngine]]:
    wait_idle(server_tiny_engine)
    proxy = CrashingEngine(server_tiny_engine.engine)
    doomed = AsyncEngine(proxy)  # type: ignore[arg-type]
    try:
        yield doomed, proxy
    finally:
        doomed.shutdown()
        for request_id in proxy.request_ids:  # what the dead loop left in the shared engine
            server_tiny_engine.engine.abort(request_id)
        wait_idle(server_tiny_engine)


async def _scenario(base: str, proxy: CrashingEngine) -> dict[str, Any]:
    async with httpx.AsyncClient(base_url=base, headers=AUTH, timeout=30) as http:
        assert (await http.get("/health")).status_code == 200
        plain = asyncio.create_task(http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 400}))
        async with http.stream("POST", "/v1/chat/completions", json=PROMPT_BODY | {"stream": True}) as stream:
            assert stream.status_code == 200
            lines = stream.aiter_lines()
            first = await anext(lines)  # the stream runs: now the step loop dies
            proxy.crash.set()
            rest = await asyncio.wait_for(_all(lines), PROMPT_TIMEOUT_S)
        plain_response = await asyncio.wait_for(plain, PROMPT_TIMEOUT_S)
        health = await http.get("/health")
        new_plain = await asyncio.wait_for(
            http.post("/v1/chat/completions", json=PROMPT_BODY), PROMPT_TIMEOUT_S
        )
        new_stream = await asyncio.wait_for(
            http.post("/v1/chat/completions", json=PROMPT_BODY | {"stream": True}), PROMPT_TIMEOUT_S
        )
    return {
        "stream": [first, *rest],
        "plain": plain_response,
        "health": health,
        "new": [new_plain, new_stream],
    }


async def _all(lines: Any) -> list[str]:
    return [line async for line in lines]


def test_a_dead_engine_answers_503_promptly(crashing: tuple[AsyncEngine, CrashingEngine]) -> None:
    doomed, proxy = crashing
    with serve(keyed_app(doomed)) as base:
        seen = asyncio.run(asyncio.wait_for(_scenario(base, proxy), 60))
    assert not doomed.is_running
    events = [line.removeprefix("data: ") for line in seen["stream"] if line]
    assert events[-1] == "[DONE]"
    assert_error_body(json.loads(events[-2]), "engine")
    assert_error(seen["plain"], 503, "engine")
    assert_error(seen["health"], 503, "not running")
    for response in seen["new"]:
        assert_error(response, 503)
