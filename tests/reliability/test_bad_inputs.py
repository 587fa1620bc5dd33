"""A corpus of malformed and hostile requests against the app on `tiny`: each gets the right 4xx with an
OpenAI error body (no 500, no traceback text), quickly, and the server then still serves a normal request."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import httpx
import pytest
from bad_input_constants import AUTH, CHAT, KEY, MSG
from bad_input_corpus import CASES, PARAMS
from bad_structured_inputs import schema_body

from structgen.engine.async_engine import AsyncEngine
from structgen.server import build_app


@pytest.fixture(scope="module")
def client(server_tiny_engine: AsyncEngine) -> Any:
    return build_app(server_tiny_engine, server_tiny_engine.engine.tokenizer, model_name="tiny", api_key=KEY)


def _send(app: Any, method: str, path: str, kwargs: dict[str, Any]) -> httpx.Response:
    kwargs = dict(kwargs)
    headers = {**AUTH, **kwargs.pop("headers", {})}
    if "auth" in kwargs:  # the Authorization header to send instead, or None for none
        auth = kwargs.pop("auth")
        headers.pop("Authorization")
        if auth is not None:
            headers["Authorization"] = auth

    async def main() -> httpx.Response:
        transport = httpx.ASGITransport(app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=60) as http:
            return await http.request(method, path, headers=headers, **kwargs)

    return asyncio.run(main())


def test_the_corpus_is_large_enough() -> None:
    assert len(CASES) >= 60
    assert len({case[0] for case in CASES}) == len(CASES)
    assert set(PARAMS) <= {case[0] for case in CASES}


@pytest.mark.parametrize(("name", "method", "path", "kwargs", "status"), CASES, ids=[c[0] for c in CASES])
def test_bad_input_gets_a_clean_4xx(
    name: str, method: str, path: str, kwargs: dict[str, Any], status: int, client: Any
) -> None:
    start = time.perf_counter()
    response = _send(client, method, path, kwargs)
    elapsed = time.perf_counter() - start
    assert response.status_code == status, f"{name}: {response.status_code} {response.text[:300]}"
    body = response.json()
    assert set(body) == {"error"} and {"message", "type", "param", "code"} <= set(body["error"]), body
    message = body["error"]["message"]
    assert message and "Traceback" not in message and 'File "' not in message, message
    assert len(message) < 5000
    if name in PARAMS:
        assert body["error"]["param"] == PARAMS[name], body
    assert elapsed < 30, f"{name} took {elapsed:.1f} s"


def test_normal_request_still_works_afterwards(client: Any, server_tiny_engine: AsyncEngine) -> None:
    for _name, method, path, kwargs, _ in CASES[:12]:  # the malformed-body part again, then a good request
        _send(client, method, path, kwargs)
    response = _send(client, "POST", CHAT, {"json": {"messages": MSG, "max_tokens": 5}})
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["choices"][0]["finish_reason"] in ("stop", "length")
    structured = _send(
        client,
        "POST",
        CHAT,
        {
            "json": schema_body(
                {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}, max_tokens=30
            )
        },
    )
    assert structured.status_code == 200, structured.text
    deadline = time.monotonic() + 10
    while server_tiny_engine.engine.has_unfinished() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not server_tiny_engine.engine.has_unfinished()
    assert json.loads(json.dumps(body))  # the body is plain JSON
