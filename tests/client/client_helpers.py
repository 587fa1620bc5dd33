"""Helpers shared by the client tests: a scripted server (`httpx.MockTransport`) and its reply builders."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

import httpx

from structgen.client import AsyncClient, Client

MODEL = "smollm2-135m"
API_KEY = "client-test-key"


def consistent(partial: Any, final: Any) -> bool:
    """Whether `partial` is what some prefix of `final`'s document may show under the documented rule."""
    if isinstance(final, dict):
        return isinstance(partial, dict) and all(
            key in final and consistent(value, final[key]) for key, value in partial.items()
        )
    if isinstance(final, list):
        if not isinstance(partial, list) or len(partial) > len(final):
            return False
        if not partial:
            return True
        *done, last = partial
        return done == final[: len(done)] and consistent(last, final[len(done)])
    if isinstance(final, str):
        return isinstance(partial, str) and final.startswith(partial)
    return partial == final and type(partial) is type(final)


MODELS = {"object": "list", "data": [{"id": "m1", "object": "model"}, {"id": "m2", "object": "model"}]}


def completion(*contents: str | None, finish_reason: str = "stop", **message: Any) -> dict[str, Any]:
    return {
        "id": "x",
        "object": "chat.completion",
        "choices": [
            {
                "index": i,
                "message": {"role": "assistant", "content": c, **message},
                "finish_reason": finish_reason,
            }
            for i, c in enumerate(contents)
        ],
    }


def sse(*events: Any) -> httpx.Response:
    body = "".join(f"data: {e if isinstance(e, str) else json.dumps(e)}\n\n" for e in events)
    return httpx.Response(200, text=body, headers={"content-type": "text/event-stream"})


def chunk(content: str | None = None, finish_reason: str | None = None) -> dict[str, Any]:
    delta = {} if content is None else {"content": content}
    return {
        "object": "chat.completion.chunk",
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason}],
    }


Reply = httpx.Response | dict[str, Any] | Exception


class Server:
    """Answers `/v1/models` itself and each other request with the next scripted reply; records the requests."""

    def __init__(self, *replies: Reply) -> None:
        self.replies = list(replies)
        self.requests: list[httpx.Request] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        if request.url.path.endswith("/models"):
            return httpx.Response(200, json=MODELS)
        reply = self.replies.pop(0)
        if isinstance(reply, Exception):
            raise reply
        return reply if isinstance(reply, httpx.Response) else httpx.Response(200, json=reply)

    def bodies(self) -> list[dict[str, Any]]:
        return [json.loads(r.content) for r in self.requests if r.method == "POST"]

    def client(self, **options: Any) -> Client:
        options.setdefault("base_url", "http://server")
        return Client(transport=httpx.MockTransport(self), **options)

    def async_client(self, **options: Any) -> AsyncClient:
        options.setdefault("base_url", "http://server")
        return AsyncClient(transport=httpx.MockTransport(self), **options)


def run_async(make: Callable[[AsyncClient], Any], server: Server, **options: Any) -> Any:
    async def main() -> Any:
        async with server.async_client(**options) as client:
            return await make(client)

    return asyncio.run(main())
