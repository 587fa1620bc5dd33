"""`AsyncClient`: the typed client over `httpx.AsyncClient`; every method is awaited, `stream_parse` iterated
with `async for`, and tool functions may be coroutine functions."""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import AsyncIterator
from typing import Any, TypeVar

import httpx

from structgen.client.api import ClientAPI
from structgen.client.core import Call, Flow
from structgen.client.errors import APIConnectionError
from structgen.client.partial import MISSING
from structgen.client.retry import decode_json, retry_delay
from structgen.client.stream import StreamDecoder

T = TypeVar("T")


class AsyncClient(ClientAPI):
    __doc__ = ClientAPI.__doc__

    _http_class = httpx.AsyncClient
    _http: httpx.AsyncClient

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def _run(self, flow: Flow[T]) -> T:
        result: Any = None
        try:
            while True:
                op = flow.send(result)
                if isinstance(op, Call):
                    response = await self._request(op, stream=False)
                    result = decode_json(response.text)
                    continue
                result = op.call.run()
                if inspect.isawaitable(result):
                    result = await result
        except StopIteration as stop:
            return stop.value  # type: ignore[no-any-return]

    async def _stream(self, flow: Flow[Any], decoder_class: type[StreamDecoder]) -> AsyncIterator[Any]:
        target, body = await self._run(flow)
        decoder = decoder_class(target)
        response = await self._request(Call("POST", "chat/completions", body), stream=True)
        try:
            async for line in response.aiter_lines():
                if (partial := decoder.feed(line)) is not MISSING:
                    yield partial
        except httpx.TransportError as error:
            raise APIConnectionError(f"the stream broke off: {error!r}") from error
        finally:
            await response.aclose()
        yield decoder.result()

    async def _request(self, call: Call, *, stream: bool) -> httpx.Response:
        """The successful response to `call` (left open for a stream) after retries; a typed error otherwise."""
        request = self._http.build_request(call.method, call.path, json=call.body)
        attempt = 0
        while True:
            failure: Any
            try:
                response = await self._http.send(request, stream=stream)
            except httpx.TransportError as error:
                failure = error
            else:
                if response.is_success:
                    return response
                await response.aread()
                await response.aclose()
                failure = response
            await asyncio.sleep(retry_delay(self.base_url, self._core.options.max_retries, attempt, failure))
            attempt += 1
