"""The retry policy (connection errors, 429 and 5xx; exponential backoff honouring `Retry-After`) and how a
failed response becomes a typed error."""

from __future__ import annotations

import email.utils
import json
import time
from typing import Any

from structgen.client.errors import APIConnectionError, ClientError, status_error

_MAX_RETRY_AFTER = 60.0  # seconds: a server asking for longer is treated as down rather than waited for


def retry_delay(base_url: str, max_retries: int, attempt: int, failure: Any) -> float:
    """Seconds to wait before retry number `attempt + 1` after `failure` (a transport exception or an error
    response, already read), or the typed error to give up with, raised."""
    if isinstance(failure, Exception):
        if attempt >= max_retries:
            raise APIConnectionError(f"cannot reach {base_url}: {failure!r}") from failure
        return _backoff(attempt)
    status = failure.status_code
    if attempt < max_retries and (status == 429 or status >= 500):
        wait = retry_after(failure.headers.get("retry-after"))
        if wait is None or wait <= _MAX_RETRY_AFTER:
            return _backoff(attempt) if wait is None else wait
    raise status_error(status, _json_or_text(failure.text), fallback=failure.reason_phrase)


def retry_after(value: str | None) -> float | None:
    """`Retry-After` in seconds: a number of seconds or an HTTP date; None when absent or unreadable."""
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - time.time())


def _backoff(attempt: int) -> float:
    return min(8.0, 0.25 * 2**attempt)


def _json_or_text(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


def decode_json(text: str) -> Any:
    """The JSON body of a successful response; a server that sends something else is a `ClientError`."""
    try:
        return json.loads(text)
    except ValueError:
        raise ClientError(f"the server sent a response that is not JSON: {text[:200]!r}") from None
