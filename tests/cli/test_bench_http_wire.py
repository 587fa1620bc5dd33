"""`structgen.bench.http_wire`: the benchmark client's HTTP/1.1 against raw stand-in servers (each test scripts
the bytes the server answers with)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable

import pytest

from structgen.bench.http_wire import JsonConnection, WireError

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


async def _read_request(reader: asyncio.StreamReader) -> dict[str, object]:
    head = (await reader.readuntil(b"\r\n\r\n")).decode()
    length = next(
        int(line.split(":")[1]) for line in head.split("\r\n") if line.lower().startswith("content-length")
    )
    return json.loads(await reader.readexactly(length))


def _json_response(body: object, *, close: bool = False) -> bytes:
    data = json.dumps(body).encode()
    extra = "Connection: close\r\n" if close else ""
    return f"HTTP/1.1 200 OK\r\nContent-Length: {len(data)}\r\n{extra}\r\n".encode() + data


async def _serve(handler: Handler, client: Callable[[str], Awaitable[None]]) -> list[int]:
    """Run `client(url)` against a server calling `handler` per connection; the connections' numbers seen."""
    seen: list[int] = []

    async def on_connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        seen.append(len(seen))
        try:
            await handler(reader, writer)
        finally:
            writer.close()

    server = await asyncio.start_server(on_connect, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    async with server:
        await client(f"http://127.0.0.1:{port}")
    return seen


def test_content_length_responses_over_one_kept_connection() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            try:
                body = await _read_request(reader)
            except asyncio.IncompleteReadError:
                return
            writer.write(_json_response({"echo": body}))

    async def client(url: str) -> None:
        connection = JsonConnection(url)
        for i in range(3):
            status, data = await connection.post("/v1/x", {"i": i})
            assert status == 200 and json.loads(data) == {"echo": {"i": i}}
        connection.close()

    assert asyncio.run(_serve(handler, client)) == [0]


def test_chunked_body_and_connection_close() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        writer.write(
            b"HTTP/1.1 400 Bad Request\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n"
            b'5\r\n{"a":\r\n3;ext=1\r\n 1}\r\n0\r\n\r\n'
        )

    async def client(url: str) -> None:
        connection = JsonConnection(url)
        for _ in range(2):  # closed by the server after each: a new connection each time
            status, data = await connection.post("/", {})
            assert status == 400 and json.loads(data) == {"a": 1}

    assert asyncio.run(_serve(handler, client)) == [0, 1]


def test_a_kept_connection_the_server_closed_is_reopened_once() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        writer.write(_json_response({"ok": True}))  # keep-alive, then closes it anyway (an idle timeout)

    async def client(url: str) -> None:
        connection = JsonConnection(url)
        assert (await connection.post("/", {}))[0] == 200
        await asyncio.sleep(0.05)
        assert (await connection.post("/", {}))[0] == 200

    assert asyncio.run(_serve(handler, client)) == [0, 1]


def test_broken_responses_raise() -> None:
    async def garbage(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        writer.write(b"SPAM 200\r\n\r\n")

    async def hang_up(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)

    async def client(url: str) -> None:
        with pytest.raises(WireError):
            await JsonConnection(url).post("/", {})

    asyncio.run(_serve(garbage, client))
    asyncio.run(_serve(hang_up, client))
    with pytest.raises(ValueError, match="http://"):
        JsonConnection("https://example.com")


def test_cancelling_a_request_closes_its_connection() -> None:
    left = asyncio.Event()

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        assert await reader.read() == b""  # never answers; sees the client leave
        left.set()

    async def client(url: str) -> None:
        task = asyncio.ensure_future(JsonConnection(url).post("/", {}))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.wait_for(left.wait(), 5)

    asyncio.run(_serve(handler, client))
