"""OpenAI error bodies: `{"error": {"message", "type", "param", "code"}}`, and the handlers that produce them.

Every failure leaves the server through one of these, so clients (the `openai` SDK included) always get the
shape they parse, and no traceback ever reaches a response body.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

logger = logging.getLogger(__name__)

# The `type` OpenAI reports for each status it uses.
_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    500: "internal_server_error",
    503: "service_unavailable",
}


class APIError(Exception):
    """An error to send as an OpenAI error body with `status`."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers


def error_body(
    status: int, message: str, *, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    kind = _ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "internal_server_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def error_response(error: APIError) -> JSONResponse:
    headers = dict(error.headers or {})
    if error.status == 401:
        headers["WWW-Authenticate"] = "Bearer"
    return JSONResponse(
        error_body(error.status, error.message, param=error.param, code=error.code),
        status_code=error.status,
        headers=headers,
    )


def _validation_message(error: RequestValidationError) -> tuple[str, str | None]:
    """One readable line for the first problem, and the offending field as OpenAI's `param` names it."""
    problems = error.errors()
    if not problems:
        return "invalid request body", None
    first = problems[0]
    if first.get("type") == "json_invalid":
        return f"the request body is not valid JSON: {first.get('ctx', {}).get('error', 'parse error')}", None
    param = ".".join(_field_path(first.get("loc", ()))) or None
    message = first.get("msg", "invalid value")
    text = f"{param}: {message}" if param else message
    if len(problems) > 1:
        text += f" (and {len(problems) - 1} more problem{'s' if len(problems) > 2 else ''})"
    return text, param


# How pydantic names the member of a union a problem was found under (`stop: str | list[str]` gives the locs
# `stop.str` and `stop.list[str]`): builtin type names, or anything with brackets.
_UNION_TAGS = frozenset({"str", "int", "float", "bool", "dict", "list", "none", "bytes"})


def _field_path(loc: tuple[Any, ...] | list[Any]) -> list[str]:
    """The field a problem is in, as OpenAI's `param` names it: the body's field names and list indexes, up to
    the first union-member tag (a client sent `stop`, not `stop.list[str]`)."""
    path: list[str] = []
    for part in loc:
        if part == "body" and not path:
            continue
        if isinstance(part, str) and (part in _UNION_TAGS or not part.isidentifier()):
            break
        path.append(str(part))
    return path


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        # OpenAI answers a bad body with 400, not FastAPI's 422 `{"detail": [...]}`.
        message, param = _validation_message(exc)
        return error_response(APIError(400, message, param=param, code="invalid_request"))

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(APIError(exc.status_code, str(exc.detail)))

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error while serving a request")
        return error_response(APIError(500, f"internal error: {type(exc).__name__}"))
