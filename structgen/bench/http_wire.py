"""A minimal HTTP/1.1 JSON client over one keep-alive connection, for the benchmark's client process.

`http_clients` keeps 32 requests in flight against a server on the same two cores. With httpx each finished
request cost its client ~1.6 ms of CPU (session 21's per-thread accounting, `tiny`, `nested`), as much as the
server's own handling of it, and that CPU came out of the forward being measured: a user's client runs on
another machine. This one writes a prebuilt request and reads the status line, the headers and a
`Content-Length` or chunked body: ~0.4 ms a request, a quarter of that work. It speaks only what the benchmark needs (POST, JSON,
no TLS, no redirects, no proxies).
"""

from __future__ import annotations

import asyncio
import json
from typing import Any
from urllib.parse import urlsplit


class WireError(RuntimeError):
    """The server broke the protocol or the connection."""


class JsonConnection:
    """POSTs JSON bodies to one host over one connection, reopened when the server closed it. Not shared
    between tasks: one request at a time. Closing it (or cancelling the task inside `post`) closes the socket,
    so the server sees the client leave."""

    def __init__(self, url: str) -> None:
        parts = urlsplit(url)
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError(f"only http://host[:port] URLs are supported, got {url!r}")
        self.host = parts.hostname
        self.port = parts.port or 80
        self.prefix = parts.path.rstrip("/")
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None

    async def post(self, path: str, body: Any) -> tuple[int, bytes]:
        """(status, response body) of a JSON POST; the body is not decoded."""
        payload = json.dumps(body, separators=(",", ":")).encode()
        head = (
            f"POST {self.prefix}{path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n\r\n"
        ).encode()
        for attempt in (0, 1):
            fresh = self._writer is None
            if fresh:
                self._reader, self._writer = await asyncio.open_connection(self.host, self.port)
            assert self._reader is not None and self._writer is not None
            try:
                self._writer.write(head + payload)
                await self._writer.drain()
                status, keep_alive, data = await _read_response(self._reader)
            except (ConnectionError, asyncio.IncompleteReadError) as error:
                self.close()
                if fresh or attempt:  # a kept-alive connection the server had closed: once more, new
                    raise WireError(f"connection to {self.host}:{self.port} failed: {error}") from error
                continue
            except BaseException:
                self.close()  # cancelled mid-request: the server must see the connection go
                raise
            if not keep_alive:
                self.close()
            return status, data
        raise AssertionError("unreachable")

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
        self._reader = self._writer = None


async def _read_response(reader: asyncio.StreamReader) -> tuple[int, bool, bytes]:
    """(status, whether the connection stays open, body) of one response."""
    try:
        raw = await reader.readuntil(b"\r\n\r\n")  # bounded by the stream's limit (64 KiB)
    except asyncio.LimitOverrunError as error:
        raise WireError("response headers too long") from error
    lines = raw.decode("latin-1").split("\r\n")
    version, _, rest = lines[0].partition(" ")
    if not version.startswith("HTTP/1.") or not rest[:3].isdigit():
        raise WireError(f"not an HTTP/1.x status line: {lines[0][:80]!r}")
    status = int(rest[:3])
    headers: dict[str, str] = {}
    for line in lines[1:]:
        if line:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
    keep_alive = headers.get("connection", "").lower() != "close" and version != "HTTP/1.0"
    if "chunked" in headers.get("transfer-encoding", "").lower():
        return status, keep_alive, await _read_chunked(reader)
    length = headers.get("content-length")
    if length is None:
        return status, False, await reader.read()  # delimited by the connection's end
    return status, keep_alive, await reader.readexactly(int(length))


async def _read_chunked(reader: asyncio.StreamReader) -> bytes:
    parts = []
    while True:
        size_line = await reader.readuntil(b"\r\n")
        try:
            size = int(size_line.split(b";", 1)[0].strip(), 16)
        except ValueError as error:
            raise WireError(f"bad chunk size line {size_line[:40]!r}") from error
        if size == 0:
            while await reader.readuntil(b"\r\n") != b"\r\n":
                pass  # trailers
            return b"".join(parts)
        parts.append(await reader.readexactly(size))
        if await reader.readexactly(2) != b"\r\n":
            raise WireError("chunk not followed by CRLF")
