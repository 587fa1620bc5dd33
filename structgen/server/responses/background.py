"""Background responses (`background: true`, OpenAI's background mode): the POST answers at once with the stored
Response in status `queued`, and the generation runs as an asyncio task on the event loop, through the same chat
pipeline as a plain request. The client polls `GET /v1/responses/{id}`: `in_progress` while the task runs, then
the Response a plain request would have answered (`completed` / `incomplete`, output, usage), or `failed` with
OpenAI's `error: {"code", "message"}`. `POST /v1/responses/{id}/cancel` (and `DELETE`, and server shutdown)
cancels the task, which aborts its engine requests as a client that hangs up does.

Resumable streams (`background` with `stream`) are not supported: the request is a 400.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import Request
from starlette.types import Message

from structgen.server.context import ServerContext
from structgen.server.errors import APIError
from structgen.server.responses.convert import responses_error
from structgen.server.responses.protocol import ResponsesRequest
from structgen.server.responses.store import ResponseStore, StoredResponse

logger = logging.getLogger("structgen.server")

# The statuses of a background response whose task has not finished.
PENDING = ("queued", "in_progress")


def check_background(ctx: ServerContext, store: ResponseStore, body: ResponsesRequest) -> None:
    """400 for a background request this server cannot take; the admission errors (429 / 503) a plain request
    would get now, so a busy or draining server refuses the POST instead of storing a response that fails."""
    if body.stream:
        raise APIError(
            400,
            "background mode with stream: true (resumable streams) is not supported: send background: true "
            "without stream and poll GET /v1/responses/{id}, or stream without background",
            param="background",
        )
    if not body.store:
        raise APIError(400, "Background mode requires store=true", param="background")
    if store.capacity == 0:
        raise APIError(
            400,
            "background mode needs the response store, which this server keeps empty (--responses-store-size 0)",
            param="background",
        )
    ctx.lifecycle.open().close()


def detached(request: Request, response_id: str) -> Request:
    """`request` for a generation that outlives it: its client never leaves, so the disconnect watch
    (`generation.unless_disconnected`) never fires (cancelling the task stops the work instead), and its own
    state, so the POST's log line is not rewritten by a generation that ends later."""

    async def never() -> Message:
        await asyncio.Future()  # cancelled with the watcher
        raise AssertionError("unreachable")

    return Request({**request.scope, "state": {"request_id": response_id}}, receive=never)


def start_background(
    store: ResponseStore, entry: StoredResponse, work: Callable[[], Awaitable[dict[str, Any]]]
) -> None:
    """Store the queued `entry` and run `work` (the finished Response object) in a task whose outcome replaces it."""
    response_id = entry.response["id"]
    task = asyncio.create_task(_run(store, entry, work), name=f"background response {response_id}")
    store.track(response_id, task)  # before `put`: a running entry is never evicted, this one included
    store.put(entry)


async def _run(
    store: ResponseStore, entry: StoredResponse, work: Callable[[], Awaitable[dict[str, Any]]]
) -> None:
    response_id = entry.response["id"]
    _update(store, entry, status="in_progress")
    try:
        response = await work()
    except asyncio.CancelledError:
        _update(store, entry, status="cancelled")
        raise
    except APIError as error:
        _update(store, entry, status="failed", error=_error_of(error))
        return
    except Exception:
        logger.exception("background response %s failed", response_id)
        message = "the server failed while generating this response"
        _update(store, entry, status="failed", error={"code": "server_error", "message": message})
        return
    context = [*entry.context, *response["output"]]
    store.replace(StoredResponse(response=response, input_items=entry.input_items, context=context))


def _error_of(error: APIError) -> dict[str, str]:
    """OpenAI's `error` of a failed Response. Its `code` is one of OpenAI's few (the SDK's model is a closed
    list), so this server's own code (`unsupported_schema`, ...) is kept at the end of the message instead."""
    error = responses_error(error)
    if error.status == 429:
        code = "rate_limit_exceeded"
    else:  # a request the pipeline refused (bad schema, prompt too long) is the prompt's fault
        code = "invalid_prompt" if 400 <= error.status < 500 else "server_error"
    where = f"{error.param}: " if error.param else ""
    suffix = f" ({error.code})" if error.code else ""
    return {"code": code, "message": f"{where}{error.message}{suffix}"}


def cancel_background(store: ResponseStore, response_id: str) -> dict[str, Any]:
    """`POST /v1/responses/{id}/cancel`: the cancelled Response (one cancelled already, unchanged, as OpenAI)."""
    entry = store.get(response_id)  # an unknown id is a 404 first
    response = entry.response
    if not response.get("background"):
        raise APIError(
            400,
            f"cannot cancel response {response_id!r}: only background responses can be cancelled, and this one "
            "was not created in the background",
            code="not_background",
        )
    status = response["status"]
    if status == "cancelled":
        return response
    if status not in PENDING:
        raise APIError(400, f"Cannot cancel a {status} response", code="response_not_cancellable")
    store.cancel(response_id)
    return _update(store, entry, status="cancelled")


def _update(store: ResponseStore, entry: StoredResponse, **fields: Any) -> dict[str, Any]:
    """`entry`'s Response with `fields` changed, stored unless the response was deleted meanwhile."""
    response = entry.response | fields
    store.replace(StoredResponse(response=response, input_items=entry.input_items, context=entry.context))
    return response
