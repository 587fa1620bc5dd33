"""The benchmark's client process (`structgen.bench.http_clients`) against a small stand-in server."""

from __future__ import annotations

import time
from typing import Any

import pytest

from structgen.bench.http_clients import ClientError, ClientProcess, Workload, staggered_max_tokens


def _app() -> Any:
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse

    app = FastAPI()

    @app.post("/v1/chat/completions")
    async def complete(body: dict[str, Any]) -> Any:
        prompt = body["messages"][0]["content"]
        if prompt.startswith("bad"):
            return JSONResponse({"error": {"message": "bad prompt", "type": "invalid_request_error"}}, 400)
        text = f"{prompt} seed={body['seed']}"
        return {
            "choices": [
                {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}
            ]
        }

    return app


@pytest.fixture(scope="module")
def url() -> Any:
    from structgen.bench.server import _Uvicorn

    with _Uvicorn(_app()) as served:
        yield served


def test_closed_loop_returns_stamped_responses_and_the_next_index(url: str) -> None:
    with ClientProcess(url, concurrency=3) as clients:
        assert clients.once({"messages": [{"role": "user", "content": "hi"}], "seed": 1})["choices"]
        workload = Workload({"model": "m"}, "req {index}", first_index=10, seed_base=100)
        start = time.monotonic()
        clients.run(workload)
        time.sleep(0.5)
        clients.raise_if_failed()
        finished, next_index = clients.stop()
        end = time.monotonic()
    assert len(finished) >= 3
    # Every index sent once, in order; a response's seed is its index plus the base.
    assert len(finished) <= next_index - 10 <= len(finished) + 3
    texts = {out.text for out in finished}
    assert len(texts) == len(finished)
    for out in finished:
        index = int(out.text.split()[1])
        assert out.text == f"req {index} seed={100 + index}" and 10 <= index < next_index
        assert start <= out.at <= end and out.finish_reason == "stop"


def test_a_failed_request_stops_the_benchmark_with_the_servers_error(url: str) -> None:
    with ClientProcess(url, concurrency=2) as clients:
        clients.run(Workload({}, "bad {index}", first_index=0, seed_base=0))
        deadline = time.monotonic() + 10
        with pytest.raises(ClientError, match=r"HTTP 400.*bad prompt"):
            while time.monotonic() < deadline:
                clients.raise_if_failed()
                time.sleep(0.01)


def test_staggered_budgets_rise_to_the_template_then_stay() -> None:
    assert [staggered_max_tokens(256, i, 32) for i in (0, 1, 30, 31, 32, 500)] == [8, 16, 248, 256, 256, 256]
    assert [staggered_max_tokens(10, i, 4) for i in range(5)] == [3, 5, 8, 10, 10]  # rounded up, never 0
    assert staggered_max_tokens(10, 0, 0) == 10  # no stagger
    workload = Workload({"max_tokens": 10}, "r {index}", first_index=7, seed_base=0, stagger=4)
    assert [workload.body(index)["max_tokens"] for index in range(7, 13)] == [3, 5, 8, 10, 10, 10]
    assert "max_tokens" not in Workload({}, "r {index}", first_index=0, seed_base=0, stagger=4).body(0)
