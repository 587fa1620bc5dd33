"""`Client`: the typed client over a blocking `httpx.Client`."""

from __future__ import annotations

import inspect
import time
from collections.abc import Iterator
from typing import Any, TypeVar

import httpx

from structgen.client.api import ClientAPI
from structgen.client.core import Call, Flow
from structgen.client.errors import APIConnectionError
from structgen.client.partial import MISSING
from structgen.client.retry import decode_json, retry_delay
from structgen.client.stream import StreamDecoder

T = TypeVar("T")


class Client(ClientAPI):
    __doc__ = ClientAPI.__doc__

    _http_class = httpx.Client
    _http: httpx.Client

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _run(self, flow: Flow[T]) -> T:
        result: Any = None
        try:
            while True:
                op = flow.send(result)
                if isinstance(op, Call):
                    result = decode_json(self._request(op, stream=False).text)
                    continue
                result = op.call.run()
                if inspect.isawaitable(result):
                    getattr(result, "close", lambda: None)()  # no "never awaited" warning
                    raise TypeError(f"tool {op.call.name!r} is async: use AsyncClient to run it")
        except StopIteration as stop:
            return stop.value  # type: ignore[no-any-return]

    def _stream(self, flow: Flow[Any], decoder_class: type[StreamDecoder]) -> Iterator[Any]:
        target, body = self._run(flow)
        decoder = decoder_class(target)
        response = self._request(Call("POST", "chat/completions", body), stream=True)
        try:
            for line in response.iter_lines():
                if (partial := decoder.feed(line)) is not MISSING:
                    yield partial
        except httpx.TransportError as error:
            raise APIConnectionError(f"the stream broke off: {error!r}") from error
        finally:
            response.close()
        yield decoder.result()

    def _request(self, call: Call, *, stream: bool) -> httpx.Response:
        """The successful response to `call` (left open for a stream) after retries; a typed error otherwise."""
        request = self._http.build_request(call.method, call.path, json=call.body)
        attempt = 0
        while True:
            failure: Any
            try:
                response = self._http.send(request, stream=stream)
            except httpx.TransportError as error:
                failure = error
            else:
                if response.is_success:
                    return response
                response.read()
                response.close()
                failure = response
            time.sleep(retry_delay(self.base_url, self._core.options.max_retries, attempt, failure))
            attempt += 1
