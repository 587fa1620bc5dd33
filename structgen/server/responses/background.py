"""Background responses (`background: true`, OpenAI's background mode): the POST answers at once with the stored
Response in status `queued`, and the generation runs as an asyncio task on the event loop, through the same chat
pipeline as a plain request. The client polls `GET /v1/responses/{id}`: `queued` until the engine runs the
request (its first output), `in_progress` while it does, then the Response a plain request would have answered
(`completed` / `incomplete`, output, usage), or `failed` with OpenAI's `error: {"code", "message"}`.
`POST /v1/responses/{id}/cancel` (and `DELETE`, and server shutdown) cancels the task, which aborts its engine
requests as a client that hangs up does.

With `stream` too (a resumable stream) the POST answers with the stream instead: the generation's events are
recorded in the response's `EventLog` (`replay.py`), which the POST and any `GET ?stream=true` read, and the
response runs on whoever reads it. The stream ends with the response: `response.completed` / `.incomplete` as a
plain stream does, `response.failed` (after an `error` event when the generation failed mid-stream), or
`response.cancelled` with the cancelled Response.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, replace
from typing import Any

from fastapi import Request
from fastapi.responses import StreamingResponse
from starlette.types import Message

from structgen.server.context import ServerContext
from structgen.server.errors import APIError
from structgen.server.generation import Call, Started
from structgen.server.lifecycle import Lifecycle
from structgen.server.responses.convert import responses_error
from structgen.server.responses.events import response_events
from structgen.server.responses.output import cached_tokens
from structgen.server.responses.protocol import ResponsesRequest
from structgen.server.responses.store import ResponseStore, StoredResponse
from structgen.server.routes_chat import ChatAnswer

logger = logging.getLogger("structgen.server")

# The statuses of a background response whose task has not finished.
PENDING = ("queued", "in_progress")
Work = Callable[[], Awaitable[dict[str, Any]]]


def check_background(ctx: ServerContext, store: ResponseStore, body: ResponsesRequest) -> None:
    """400 for a background request this server cannot take; the admission errors (429 / 503) a plain request
    would get now, so a busy or draining server refuses the POST instead of storing a response that fails."""
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


def start_background(lifecycle: Lifecycle, store: ResponseStore, entry: StoredResponse, work: Work) -> None:
    """Store the queued `entry` and run `work` (the finished Response object) in a task whose outcome replaces it."""
    response_id = entry.response["id"]
    task = asyncio.create_task(_run(lifecycle, store, entry, work), name=f"background response {response_id}")
    # A task cancelled before it ran never enters `_run`: the callback settles every cancelled one.
    task.add_done_callback(lambda done: _cancelled(store, entry) if done.cancelled() else None)
    store.track(response_id, task)  # before `put`: a running entry is never evicted, this one included
    store.put(entry)


async def _run(lifecycle: Lifecycle, store: ResponseStore, entry: StoredResponse, work: Work) -> None:
    response_id = entry.response["id"]
    try:
        with lifecycle.on_start(response_id, lambda: _move(store, entry, {"status": "in_progress"})):
            response = await work()
    except APIError as error:
        _failed(store, entry, _error_of(error))
        return
    except Exception:
        logger.exception("background response %s failed", response_id)
        message = "the server failed while generating this response"
        _failed(store, entry, {"code": "server_error", "message": message})
        return
    finished(store, entry, response)
    # A stream has sent its final event already (`Recording`): this only counts its events against the store's.
    _end_stream(store, entry, response)


def finished(store: ResponseStore, entry: StoredResponse, response: dict[str, Any]) -> None:
    """`entry` has its final Response `response` (`completed` / `incomplete`): its output joins the context."""
    _move(store, entry, response, context=[*entry.context, *response["output"]])


def _failed(store: ResponseStore, entry: StoredResponse, error: dict[str, str]) -> None:
    _end_stream(store, entry, _move(store, entry, {"status": "failed", "error": error}))


def _cancelled(store: ResponseStore, entry: StoredResponse) -> None:
    _end_stream(store, entry, _move(store, entry, {"status": "cancelled"}))


def _end_stream(store: ResponseStore, entry: StoredResponse, response: dict[str, Any]) -> None:
    """End `entry`'s stream (if it has one) with the final event of `response` as it ended (`response.failed`,
    `.cancelled`), unless the stream has ended already."""
    if entry.events is not None:
        entry.events.end(f"response.{response['status']}", response)
        store.trim_logs()


def _move(
    store: ResponseStore,
    entry: StoredResponse,
    fields: dict[str, Any],
    *,
    context: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """`entry`'s Response with `fields` changed, stored unless the response has left `PENDING` meanwhile
    (cancelled, or finished while its task winds down: that one stays) or was deleted; returns the Response
    as it now is."""
    current = store.peek(entry.response["id"])
    if current is not None and current.response["status"] not in PENDING:
        return current.response
    response = entry.response | fields
    if current is not None:
        store.replace(
            replace(current, response=response, context=current.context if context is None else context)
        )
    return response


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
    store.cancel(response_id)  # its stream ends (`response.cancelled`) once the task has stopped
    return _move(store, entry, {"status": "cancelled"})


@dataclass(slots=True)
class Recording:
    """The generation of a background stream, run without a client: `rewrite` (a `run_chat` rewriter) records its
    events in `entry.events`, and `drain` runs the pipeline's SSE response to its end."""

    store: ResponseStore
    entry: StoredResponse
    head: dict[str, Any]  # `output.response_head`
    final: dict[str, Any] | None = None
    error: APIError | None = None

    def rewrite(
        self, call: Call, started: list[Started], chunks: AsyncIterator[dict[str, Any]]
    ) -> AsyncIterator[dict[str, Any]]:
        events = response_events(
            chunks,
            head=self.head,
            cached_tokens=cached_tokens(started),
            on_done=self._done,
            on_error=self._error,
            queued=True,  # the POST sent `queued_events`
        )
        return self._record(events)

    def _done(self, response: dict[str, Any]) -> None:
        # Stored before `response.completed` goes out, as a plain stream does: a reader of that event that
        # fetches the response finds it finished.
        self.final = response
        finished(self.store, self.entry, response)

    def _error(self, error: APIError) -> None:
        self.error = error

    async def _record(self, events: AsyncIterator[dict[str, Any]]) -> AsyncIterator[dict[str, Any]]:
        # The SSE response this feeds has no client: the events go to the log only (encoded once, there).
        log = self.entry.events
        assert log is not None
        async for event in events:
            log.append(event)
        return
        yield  # an async generator that yields nothing

    async def drain(self, answer: StreamingResponse | ChatAnswer) -> dict[str, Any]:
        """Run `answer` (what `run_chat` returned) to its end: the final Response, or raise the stream's error."""
        assert isinstance(answer, StreamingResponse)  # a streamed request
        try:
            async for _ in answer.body_iterator:
                pass
        finally:
            if answer.background is not None:  # closes the ticket even when the body never started
                await answer.background()
        if self.final is not None:
            return self.final
        raise self.error or APIError(500, "the stream ended without its final event", code="internal_error")
