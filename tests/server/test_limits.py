"""Body size limit (413), admission control (429 + Retry-After), `/metrics` (Prometheus, auth), a plain request
whose client leaves, `echo`, and chat messages without `tool_calls`, on `tiny`."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from live_server import serve, wait_idle
from prometheus_client.parser import text_string_to_metric_families
from server_helpers import AUTH, KEY, USER, assert_error, call, sse_events, tiny_engine

from structgen.engine.async_engine import AsyncEngine
from structgen.server import build_app
from structgen.server.limits import BodySizeLimit, ServerLimits

LIMIT = 4096


def new_app(engine: AsyncEngine) -> Any:
    limits = ServerLimits(max_request_bytes=LIMIT)
    return build_app(engine, engine.engine.tokenizer, model_name="tiny", api_key=KEY, limits=limits)


@pytest.fixture
def app(engine: AsyncEngine) -> Any:
    """A fresh app per test: leaving `serve` shuts an app down (its lifespan drains it for good)."""
    return new_app(engine)


# -- 413 ------------------------------------------------------------------------------------------------------


def test_a_50_mb_body_is_refused_without_being_read() -> None:
    reached_app = False

    async def inner(scope: Any, receive: Any, send: Any) -> None:
        nonlocal reached_app
        reached_app = True

    async def run(declared: bool) -> tuple[int, list[Any]]:
        chunk = b"x" * (1 << 20)
        pulled = 0

        async def receive() -> dict[str, Any]:
            nonlocal pulled
            pulled += 1
            return {"type": "http.request", "body": chunk, "more_body": pulled < 50}

        sent: list[Any] = []

        async def send(message: dict[str, Any]) -> None:
            sent.append(message)

        headers = [(b"content-length", str(50 << 20).encode())] if declared else []
        scope = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": headers}
        await BodySizeLimit(inner, max_bytes=2 << 20)(scope, receive, send)
        return pulled, sent

    for declared, most_pulled in ((True, 0), (False, 3)):  # chunked: stops right after passing 2 MiB
        pulled, sent = asyncio.run(run(declared))
        assert pulled == most_pulled and not reached_app
        assert sent[0]["status"] == 413


def test_413_over_http_declared_and_chunked(app: Any) -> None:
    with serve(app) as url, httpx.Client(base_url=url, headers=AUTH, timeout=30) as client:
        big = b'{"prompt": "' + b"a" * (LIMIT + 10) + b'"}'
        assert_error(client.post("/v1/completions", content=big), 413, str(LIMIT))

        def chunks() -> Iterator[bytes]:
            yield b'{"prompt": "'
            for _ in range(10):
                yield b"a" * 1000
            yield b'"}'

        assert_error(client.post("/v1/completions", content=chunks()), 413, "too large")
        ok = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert ok.status_code == 200, ok.text


# -- /metrics -------------------------------------------------------------------------------------------------


def _scrape(app: Any, headers: dict[str, str] | None = AUTH) -> dict[str, float]:
    response = call(app, "GET", "/metrics", headers=headers)
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain")
    return {
        (s.name + "".join(f"|{k}={v}" for k, v in sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(response.text)
        for s in family.samples
    }


def test_metrics_follow_the_key_and_count_what_happened(app: Any, engine: AsyncEngine) -> None:
    before = _scrape(app)
    assert_error(call(app, "GET", "/metrics", headers=None), 401)
    regex = {"prompt": "id:", "max_tokens": 8, "guided_regex": "[ab]{3}"}
    assert call(app, "POST", "/v1/completions", json=regex).status_code == 200
    assert call(app, "POST", "/v1/completions", json=regex).status_code == 200  # a compile cache hit
    chat = {"messages": USER, "max_tokens": 3, "ignore_eos": True}
    assert call(app, "POST", "/v1/chat/completions", json=chat).status_code == 200
    assert call(app, "POST", "/v1/chat/completions", json=chat | {"model": "nope"}).status_code == 404
    wait_idle(engine)
    after = _scrape(app)

    def grew(name: str) -> float:
        return after[name] - before.get(name, 0.0)

    assert grew("structgen_http_requests_total|method=POST|route=/v1/completions|status=200") == 2
    assert grew("structgen_http_requests_total|method=POST|route=/v1/chat/completions|status=404") == 1
    assert grew("structgen_http_requests_total|method=GET|route=/metrics|status=401") == 1
    assert grew("structgen_structured_outputs_total|path=exact|valid=true") == 2
    assert grew("structgen_grammar_cache_hits_total") >= 1
    assert grew("structgen_e2e_request_latency_seconds_count") == 3
    assert grew("structgen_time_to_first_token_seconds_count") == 3
    assert grew("structgen_generation_tokens_total") >= 3 + 2
    assert grew("structgen_prompt_tokens_total") > 0
    assert after["structgen_grammar_compile_seconds_count"] >= 1
    assert after["structgen_jump_forward_tokens_total"] >= 0
    assert after["structgen_kv_blocks_used"] == 0 and after["structgen_kv_cache_usage_ratio"] == 0
    stats = engine.engine.stats()
    assert after["structgen_kv_blocks_free"] == stats.kv_blocks_total == after["structgen_kv_blocks_total"]
    for gauge in ("requests_running", "requests_waiting", "http_requests_in_flight", "http_requests_queued"):
        assert after[f"structgen_{gauge}"] == 0
    for name in (
        "preemptions_total",
        "prefix_cache_hit_rate",
        "structured_retries_total",
        "requests_aborted_total",
    ):
        assert f"structgen_{name}" in after
    open_app = build_app(engine, engine.engine.tokenizer, model_name="tiny")  # a second registry: no clash
    assert "structgen_kv_blocks_total" in _scrape(open_app, headers=None)


# -- 429 ------------------------------------------------------------------------------------------------------


def test_429_when_the_waiting_queue_is_full() -> None:
    one_seq = tiny_engine(max_num_seqs=1)
    step = one_seq.engine.step
    released = threading.Event()

    def slow_step() -> Any:
        # 50 ms a step until the 429 is checked: the long request holds its slot for 100 s, however fast tiny is
        # and however long a loaded machine takes to queue the waiter (5 ms a step once let it finish first).
        released.wait(0.05)
        return step()

    one_seq.engine.step = slow_step  # type: ignore[method-assign]
    limits = ServerLimits(max_waiting_requests=1, max_request_bytes=LIMIT)
    app = build_app(one_seq, one_seq.engine.tokenizer, model_name="tiny", limits=limits)
    lifecycle = app.state.server.lifecycle
    long = {"prompt": "run", "max_tokens": 2000, "ignore_eos": True, "stream": True}
    try:
        with serve(app) as url, httpx.Client(base_url=url, timeout=30) as client:
            with client.stream("POST", "/v1/completions", json=long) as running:
                assert running.status_code == 200
                next(running.iter_lines())  # it holds the only sequence slot now
                answered: list[Any] = []  # what the waiter got, for the message if it never queues

                def wait_for_the_slot() -> None:
                    try:
                        answered.append(client.post("/v1/completions", json={"prompt": "x", "max_tokens": 1}))
                    except Exception as exc:
                        answered.append(exc)

                waiter = threading.Thread(target=wait_for_the_slot)
                waiter.start()
                deadline = time.monotonic() + 30  # (the long request holds its slot for 100 s)
                while lifecycle.num_queued < 1:
                    assert time.monotonic() < deadline, f"the second request never queued; it got {answered}"
                    time.sleep(0.01)
                refused = client.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 1})
                assert_error(refused, 429, "busy")
                assert refused.headers["retry-after"] == "1"
                released.set()
            waiter.join(30)  # the running stream was dropped: the waiting request gets the slot and finishes
            assert not waiter.is_alive()
            assert client.post("/v1/completions", json={"prompt": "x", "max_tokens": 1}).status_code == 200
        wait_idle(one_seq)
    finally:
        released.set()
        one_seq.shutdown()


# -- client disconnects, echo, tool_calls ---------------------------------------------------------------------


def test_a_plain_request_is_aborted_when_its_client_leaves(app: Any, engine: AsyncEngine) -> None:
    aborted = engine.engine.stats().num_requests_aborted
    body = {"prompt": "count", "max_tokens": 1500, "ignore_eos": True}
    with serve(app) as url, httpx.Client(base_url=url, headers=AUTH, timeout=0.5) as client:
        for path, extra in (("/v1/completions", {}), ("/v1/chat/completions", {"messages": USER})):
            with pytest.raises(httpx.ReadTimeout):
                client.post(path, json=body | extra)
    wait_idle(engine, timeout=5)  # aborted at once, not 1500 tokens later
    stats = engine.engine.stats()
    assert stats.num_requests_aborted == aborted + 2 and stats.kv_blocks_used == 0


def test_echo_and_no_tool_calls(app: Any) -> None:
    body = {"prompt": "Echo me", "max_tokens": 3, "ignore_eos": True, "echo": True, "seed": 2}
    plain = call(app, "POST", "/v1/completions", json=body).json()["choices"][0]["text"]
    assert plain.startswith("Echo me") and len(plain) > len("Echo me")
    events = sse_events(call(app, "POST", "/v1/completions", json=body | {"stream": True}))
    assert "".join(e["choices"][0]["text"] for e in events) == plain
    tokens = call(app, "POST", "/v1/completions", json=body | {"prompt": [8, 9, 10]}).json()
    assert tokens["choices"][0]["text"].startswith(app.state.server.tokenizer.decode([8, 9, 10]))
    # With logprobs, the echoed prompt's tokens lead them (`test_prompt_logprobs.py` checks them in full).
    scored = call(app, "POST", "/v1/completions", json=body | {"logprobs": 1}).json()["choices"][0]
    assert scored["logprobs"]["token_logprobs"][0] is None and len(scored["logprobs"]["tokens"]) > 3
    message = call(app, "POST", "/v1/chat/completions", json={"messages": USER, "max_tokens": 2}).json()
    assert message["choices"][0]["message"].get("tool_calls") is None


def test_a_recursive_schema_is_served_on_the_restricted_path(app: Any, engine: AsyncEngine) -> None:
    """A `$ref` cycle with sibling keywords (llguidance refuses it as is) is served unrolled, not a 400."""
    node = {
        "type": "object",
        "properties": {
            "v": {"type": "integer"},
            "next": {"$ref": "#/$defs/node", "type": "object", "required": ["v"]},
        },
        "required": ["v"],
        "additionalProperties": False,
    }
    schema = {"$defs": {"node": node}, "$ref": "#/$defs/node"}
    before = _scrape(app)
    body = {
        "messages": USER,
        "max_tokens": 48,
        "response_format": {"type": "json_schema", "json_schema": {"name": "chain", "schema": schema}},
    }
    response = call(app, "POST", "/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    wait_idle(engine)
    after = _scrape(app)
    counted = {
        k: after[k] - before.get(k, 0.0) for k in after if k.startswith("structgen_structured_outputs_total")
    }
    assert sum(v for k, v in counted.items() if "path=restricted" in k) == 1, counted
