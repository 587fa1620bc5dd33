"""Server limits (`--max-request-bytes`, `--max-waiting-requests`, `--shutdown-timeout`) and the body-size
guard.

The guard is pure ASGI and sits in front of FastAPI: a declared `Content-Length` over the limit is refused before
any byte is read, and a body without one (chunked) is counted as it arrives and refused the moment it passes the
limit, so a 50 MB upload never sits in memory. An accepted body (at most the limit) is replayed to the app; later
`receive()` calls go straight through, so the routes still see the client's disconnect.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from structgen.server.errors import error_body

DEFAULT_MAX_REQUEST_BYTES = 16 * 1024 * 1024


@dataclass(slots=True, frozen=True, kw_only=True)
class ServerLimits:
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    # Requests accepted but not yet producing their first token; past it new generations get 429.
    max_waiting_requests: int = 512
    # SIGTERM: how long in-flight requests may take to finish before they are aborted.
    shutdown_timeout_s: float = 30.0
    retry_after_s: int = 1

    def __post_init__(self) -> None:
        if self.max_request_bytes < 1:
            raise ValueError(f"max_request_bytes must be >= 1, got {self.max_request_bytes}")
        if self.max_waiting_requests < 0:
            raise ValueError(f"max_waiting_requests must be >= 0, got {self.max_waiting_requests}")
        if self.shutdown_timeout_s < 0:
            raise ValueError(f"shutdown_timeout_s must be >= 0, got {self.shutdown_timeout_s}")


class BodySizeLimit:
    """Pure ASGI middleware answering 413 (OpenAI error body) to a request body over `max_bytes`."""

    def __init__(self, app: Any, *, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS"):
            await self.app(scope, receive, send)
            return
        declared = _content_length(scope)
        if declared is not None and declared > self.max_bytes:
            await self._refuse(send, declared)
            return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left while sending
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                await self._refuse(send, None)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay() -> dict[str, Any]:
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": b"".join(chunks), "more_body": False}

        await self.app(scope, replay, send)

    async def _refuse(self, send: Any, declared: int | None) -> None:
        size = f"{declared} bytes" if declared is not None else "more bytes"
        message = f"the request body is too large: {size} over the limit of {self.max_bytes} bytes"
        body = json.dumps(error_body(413, message, code="request_too_large")).encode()
        # `Connection: close`: the rest of the body is never read, so the connection cannot be reused.
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            (b"connection", b"close"),
        ]
        await send({"type": "http.response.start", "status": 413, "headers": headers})
        await send({"type": "http.response.body", "body": body})


def _content_length(scope: dict[str, Any]) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None
