"""The typed exceptions of the client: HTTP failures by status, a server that cannot be reached, and outputs
that cannot become the requested type (cut off by `max_tokens`, or not valid for the type)."""

from __future__ import annotations

from typing import Any


class ClientError(Exception):
    """Base class of every error `structgen.client` raises."""


class APIConnectionError(ClientError):
    """The server could not be reached (refused, reset, timed out), after the configured retries."""


class APIStatusError(ClientError):
    """The server answered with an error status; `message`, `code`, `type` and `param` come from its
    OpenAI-style error body when it sent one."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        code: str | None = None,
        type: str | None = None,
        param: str | None = None,
        body: Any = None,
    ) -> None:
        super().__init__(f"HTTP {status}: {message}")
        self.status, self.message, self.body = status, message, body
        self.code, self.type, self.param = code, type, param


class BadRequestError(APIStatusError):
    """400: a bad request body, or a schema the server cannot enforce (the message names the keyword)."""


class AuthenticationError(APIStatusError):
    """401: a wrong or missing API key."""


class NotFoundError(APIStatusError):
    """404: an unknown model or path."""


class RateLimitError(APIStatusError):
    """429: too many requests (retried first, honouring `Retry-After`)."""


class InternalServerError(APIStatusError):
    """5xx (retried first)."""


class OutputError(ClientError):
    """The server answered, but its output cannot become the requested type; `raw_text` is what it sent, and
    `reasoning` the reasoning it reported beside it (reasoning models; None otherwise)."""

    def __init__(self, message: str, *, raw_text: str | None, reasoning: str | None = None) -> None:
        super().__init__(message)
        self.raw_text = raw_text
        self.reasoning = reasoning


class TruncatedOutputError(OutputError):
    """The output stopped at `max_tokens` (`finish_reason="length"`) before the value was complete."""


class OutputValidationError(OutputError):
    """The output is not valid JSON for the requested type (or names an unknown tool); `errors` holds the
    validator's complaints when there are any."""

    def __init__(
        self,
        message: str,
        *,
        raw_text: str | None,
        errors: list[Any] | None = None,
        reasoning: str | None = None,
    ) -> None:
        super().__init__(message, raw_text=raw_text, reasoning=reasoning)
        self.errors = errors or []


_BY_STATUS: dict[int, type[APIStatusError]] = {
    400: BadRequestError,
    401: AuthenticationError,
    404: NotFoundError,
    429: RateLimitError,
}
# An error event inside a stream carries no status: recover it from OpenAI's error `type`.
_STATUS_OF_TYPE = {
    "invalid_request_error": 400,
    "authentication_error": 401,
    "not_found_error": 404,
    "rate_limit_error": 429,
}


def status_error(status: int, body: Any, *, fallback: str = "") -> APIStatusError:
    """The typed error for an HTTP error `status` and its (decoded) body, OpenAI-shaped or not."""
    error = body.get("error") if isinstance(body, dict) else None
    if isinstance(error, dict):
        message = str(error.get("message") or fallback)
        fields = {key: error.get(key) for key in ("code", "type", "param")}
    else:
        # Not OpenAI's shape (a proxy's HTML page, FastAPI's `{"detail": ...}`): keep the text as the message.
        message = str(body.get("detail", body) if isinstance(body, dict) else body or fallback)
        fields = {}
    kind = _BY_STATUS.get(status, InternalServerError if status >= 500 else APIStatusError)
    return kind(status, message or f"HTTP {status}", body=body, **fields)


def stream_error(event: dict[str, Any]) -> APIStatusError:
    """The typed error for an `{"error": {...}}` event sent inside an SSE stream."""
    status = _STATUS_OF_TYPE.get(str(event["error"].get("type")), 500)
    return status_error(status, event)
