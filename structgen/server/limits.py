"""Server limits (`--max-request-bytes`, `--max-waiting-requests`, `--shutdown-timeout`, `--max-tokens-default`,
`--responses-store-size`) and the body-size guard.

The guard is pure ASGI and sits in front of FastAPI: a declared `Content-Length` over the limit is refused before
any byte is read, and a body without one (chunked) is counted as it arrives and refused the moment it passes the
limit, so a 50 MB upload never sits in memory. An accepted body (at most the limit) is replayed to the app; later
`receive()` calls go straight through, so the routes still see the client's disconnect.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from structgen.server.errors import APIError, error_body

if TYPE_CHECKING:
    from structgen.sampling_params import SamplingParams

DEFAULT_MAX_REQUEST_BYTES = 16 * 1024 * 1024
# The output cap of a chat request that gives no max_tokens (`--max-tokens-default`). 4,096 is what OpenAI's own
# models long capped output at, more than any answer a caller waits for, and it bounds an uncapped request to
# ~20 s of SmolLM2 decode on a CPU, where the context left (8k for SmolLM2, 32k-128k for Qwen / Llama
# checkpoints) would let it hold a sequence slot and its KV blocks for minutes.
DEFAULT_MAX_TOKENS = 4096
# Stored responses (`--responses-store-size`): a conversation is a few KB of items, so 1,024 of them stay in the
# megabytes while covering the follow-ups of a busy agent loop.
DEFAULT_RESPONSES_STORE_SIZE = 1024


@dataclass(slots=True, frozen=True, kw_only=True)
class ServerLimits:
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    # Requests accepted but not yet producing their first token; past it new generations get 429.
    max_waiting_requests: int = 512
    # SIGTERM: how long in-flight requests may take to finish before they are aborted.
    shutdown_timeout_s: float = 30.0
    retry_after_s: int = 1
    # A chat request without max_tokens / max_completion_tokens stops here (or where the context ends).
    max_tokens_default: int = DEFAULT_MAX_TOKENS
    # Responses kept for `GET /v1/responses/{id}` and `previous_response_id` (an LRU; 0 keeps none).
    responses_store_size: int = DEFAULT_RESPONSES_STORE_SIZE

    def __post_init__(self) -> None:
        if self.max_request_bytes < 1:
            raise ValueError(f"max_request_bytes must be >= 1, got {self.max_request_bytes}")
        if self.max_waiting_requests < 0:
            raise ValueError(f"max_waiting_requests must be >= 0, got {self.max_waiting_requests}")
        if self.shutdown_timeout_s < 0:
            raise ValueError(f"shutdown_timeout_s must be >= 0, got {self.shutdown_timeout_s}")
        if self.max_tokens_default < 1:
            raise ValueError(f"max_tokens_default must be >= 1, got {self.max_tokens_default}")
        if self.responses_store_size < 0:
            raise ValueError(f"responses_store_size must be >= 0, got {self.responses_store_size}")


def with_default_max_tokens(
    params: SamplingParams, *, default: int, prompt_tokens: int, max_sequence_tokens: int
) -> SamplingParams:
    """`params` capped at `default` tokens, or at the context left after the prompt when that is less. A prompt
    that leaves no room keeps max_tokens unset, so the engine's own "prompt too long" 400 answers it."""
    room = max_sequence_tokens - prompt_tokens
    if room < 1:
        return params
    try:
        return replace(params, max_tokens=min(default, room))
    except ValueError as error:  # min_tokens above the cap
        raise APIError(400, str(error), param="min_tokens", code="invalid_value") from None


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
