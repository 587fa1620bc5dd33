"""Graceful shutdown on `tiny`: `Lifecycle.drain` lets requests finish within the timeout and aborts the rest (a
stream ends with an error event, a plain request gets 503), and a real `structgen serve` does it on SIGTERM."""

from __future__ import annotations

import asyncio
import json
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

import httpx
from live_server import serve, start_structgen_serve, wait_idle
from server_helpers import USER, assert_error, assert_error_body, call

from structgen.engine.async_engine import AsyncEngine
from structgen.server import build_app

LONG = {"prompt": "go", "max_tokens": 1500, "ignore_eos": True}


def in_thread(work: Callable[[], Any]) -> tuple[threading.Thread, list[Any]]:
    result: list[Any] = []
    thread = threading.Thread(target=lambda: result.append(work()), daemon=True)
    thread.start()
    return thread, result


def stream_lines(url: str, body: dict[str, Any], started: threading.Event) -> list[str]:
    """Every non-empty SSE line of a streamed completion; sets `started` after the first one."""
    lines = []
    with (
        httpx.Client(base_url=url, timeout=60) as client,
        client.stream("POST", "/v1/completions", json=body | {"stream": True}) as response,
    ):
        for line in response.iter_lines():
            if line:
                lines.append(line)
                started.set()
    return lines


def wait_for(condition: Callable[[], bool], timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_drain_waits_for_requests_that_finish_in_time(engine: AsyncEngine) -> None:
    app = build_app(engine, engine.engine.tokenizer, model_name="tiny")
    lifecycle = app.state.server.lifecycle
    with serve(app) as url:
        body = {"prompt": "go", "max_tokens": 20, "ignore_eos": True}
        thread, result = in_thread(lambda: httpx.post(f"{url}/v1/completions", json=body, timeout=60))
        wait_for(lambda: len(lifecycle.tickets) == 1)
        assert asyncio.run(lifecycle.drain(60)) == 0
        thread.join(10)
        assert result[0].status_code == 200 and result[0].json()["choices"][0]["finish_reason"] == "length"
    wait_idle(engine)


def test_drain_aborts_what_is_left_after_the_timeout(engine: AsyncEngine) -> None:
    app = build_app(engine, engine.engine.tokenizer, model_name="tiny")
    lifecycle = app.state.server.lifecycle
    with serve(app) as url:
        started = threading.Event()
        streamer, lines = in_thread(lambda: stream_lines(url, LONG, started))
        plain, response = in_thread(lambda: httpx.post(f"{url}/v1/completions", json=LONG, timeout=60))
        started.wait(20)
        wait_for(lambda: len(lifecycle.tickets) == 2 and lifecycle.num_queued == 0)
        assert asyncio.run(lifecycle.drain(0.2)) == 2
        streamer.join(20)
        plain.join(20)
        assert lines[0][-1] == "data: [DONE]"
        error = assert_error_body(json.loads(lines[0][-2].removeprefix("data: ")), "shut down")
        assert error["code"] == "shutting_down"
        assert assert_error(response[0], 503, "shut down")["code"] == "shutting_down"
    refused = call(
        app, "POST", "/v1/chat/completions", json={"messages": USER, "max_tokens": 1}, headers=None
    )
    assert_error(refused, 503, "shutting down")
    wait_idle(engine)
    assert engine.engine.stats().kv_blocks_used == 0


def test_sigterm_on_structgen_serve_aborts_in_flight_streams_and_exits() -> None:
    args = ["--model", "tiny", "--device", "cpu", "--kv-cache-tokens", "2048", "--shutdown-timeout", "0.5"]
    server, url = start_structgen_serve(args)
    try:
        started = threading.Event()
        streamer, lines = in_thread(lambda: stream_lines(url, LONG, started))
        assert started.wait(30)
        server.send_signal(signal.SIGTERM)
        streamer.join(30)
        # Drained and shut down: a normal exit (uvicorn would re-raise the signal; GracefulServer does not).
        assert server.wait(30) == 0
    finally:
        if server.poll() is None:
            server.kill()
    log = server.stdout.read() if server.stdout else ""
    assert lines[0][-1] == "data: [DONE]", log
    assert json.loads(lines[0][-2].removeprefix("data: "))["error"]["code"] == "shutting_down"
    assert "aborted 1 in-flight request" in log
