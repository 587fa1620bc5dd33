"""The server's OpenAPI document, served at `/openapi.json` behind the API key like every route but `/health`.

FastAPI derives the request bodies from the pydantic models in `protocol.py`; this adds what it cannot see: every
failure is an OpenAI error body (FastAPI would document a 422 `{"detail": [...]}` this server never sends), and a
generation route answers either JSON or, with `stream: true`, Server-Sent Events. Clients and fuzzers
(schemathesis) then read a document that matches what the server really does.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse
from pydantic import BaseModel


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    """OpenAI's error body, which every 4xx and 5xx of this server carries."""

    error: ErrorDetail


_SCHEMAS = "#/components/schemas/{model}"


def generation_responses(model: type[BaseModel]) -> dict[int | str, dict[str, Any]]:
    """The `responses` of a generation route answering `model`, or an SSE stream of its chunks."""
    # Each Server-Sent Event: its `data` is a JSON chunk (or the closing `[DONE]`).
    event = {"type": "object", "properties": {"data": {"type": "string"}}, "required": ["data"]}
    sse = {"text/event-stream": {"schema": event}}
    return {200: {"model": model, "description": "the completion, or its chunks as SSE", "content": sse}}


def add_openapi_route(app: FastAPI, *, dependencies: Sequence[Any]) -> None:
    @app.get("/openapi.json", dependencies=list(dependencies), include_in_schema=False)
    async def openapi_json() -> JSONResponse:
        return JSONResponse(document(app))


def document(app: FastAPI) -> dict[str, Any]:
    """The app's OpenAPI document (built once)."""
    if app.openapi_schema is None:
        doc = get_openapi(title=app.title, version=app.version, routes=app.routes)
        schemas = doc.setdefault("components", {}).setdefault("schemas", {})
        for unused in ("HTTPValidationError", "ValidationError"):
            schemas.pop(unused, None)
        error = ErrorResponse.model_json_schema(ref_template=_SCHEMAS)
        schemas.update(error.pop("$defs", {}))
        schemas["ErrorResponse"] = error
        failure = {
            "description": "an OpenAI error body",
            "content": {"application/json": {"schema": {"$ref": _SCHEMAS.format(model="ErrorResponse")}}},
        }
        for operations in doc.get("paths", {}).values():
            for operation in operations.values():
                responses = operation.setdefault("responses", {})
                responses.pop("422", None)
                responses["default"] = failure
        app.openapi_schema = doc
    return app.openapi_schema
