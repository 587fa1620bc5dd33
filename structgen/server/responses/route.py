"""`POST /v1/responses` and the stored responses behind `GET` / `DELETE /v1/responses/{id}`,
`POST /v1/responses/{id}/cancel` and `GET /v1/responses/{id}/input_items`.

A request is served by the chat pipeline (`routes_chat.run_chat`): converted into a `ChatCompletionRequest`,
answered, and the answer (or its chunk stream) converted back. A `background: true` request (`store: true`) is
checked as far as the pipeline would before its engine request runs (`prepare.py`: a 400 now, not a `failed`
response later), then answered at once with its stored `queued` Response (or with `stream`, its resumable event
stream) while the same pipeline runs it in a task (`background.py`); `cancel` stops such a task, and answers a
400 for a response not created in the background or already finished, as OpenAI does. `DELETE` of a running
background response cancels it too. `GET /v1/responses/{id}?stream=true[&starting_after=N]` streams the events
of a response created with `background` and `stream`, after N, then live (`replay.py`).
"""

from __future__ import annotations

from typing import Any, Literal

from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse, StreamingResponse

from structgen.server.context import ServerContext
from structgen.server.errors import APIError
from structgen.server.generation import Call, Started
from structgen.server.openapi import generation_responses
from structgen.server.responses.background import (
    PENDING,
    Recording,
    cancel_background,
    check_background,
    detached,
    start_background,
)
from structgen.server.responses.convert import chat_request, input_items, responses_error
from structgen.server.responses.events import queued_events, response_events
from structgen.server.responses.output import (
    cached_tokens,
    from_choice,
    response_head,
    response_object,
    usage_of,
)
from structgen.server.responses.prepare import check_prepared
from structgen.server.responses.protocol import (
    DeletedResponse,
    InputItemList,
    Response,
    ResponsesRequest,
    new_id,
)
from structgen.server.responses.replay import EventLog, cursor, event_stream
from structgen.server.responses.store import ResponseStore, StoredResponse
from structgen.server.routes_chat import ChatAnswer, ChunkStream, run_chat
from structgen.server.routes_models import resolve_model

MAX_LIST_LIMIT = 100


def add_responses_routes(router: APIRouter, ctx: ServerContext) -> ResponseStore:
    """Add the Responses API to `router`; returns its store (sized by `ctx.limits.responses_store_size`)."""
    store = ResponseStore(ctx.limits.responses_store_size)

    # Nobody can fetch a background response once the server is gone: stop them as draining starts, rather
    # than holding shutdown for them until its timeout.
    ctx.lifecycle.on_drain(store.close)

    @router.post("/responses", response_model=None, responses=generation_responses(Response))
    async def create(body: ResponsesRequest, request: Request) -> Any:
        try:
            return await _create(ctx, store, body, request)
        except APIError as error:
            raise responses_error(error) from None

    # With `stream=true`: the response's events (`replay.py`), as SSE.
    @router.get("/responses/{response_id}", response_model=None, responses=generation_responses(Response))
    async def retrieve(
        response_id: str, stream: bool = False, starting_after: str | None = None
    ) -> JSONResponse | StreamingResponse:
        entry = store.get(response_id)
        if not stream:
            return JSONResponse(entry.response)
        if not entry.streamed:
            raise APIError(
                400,
                f"response {response_id!r} was not created with background=true and stream=true: only such a "
                "response can be streamed (GET it without stream)",
                param="stream",
            )
        if entry.events is None:
            raise APIError(
                400,
                f"the events of response {response_id!r} are no longer kept (the server keeps a bounded amount "
                "of finished responses' events, least recently used dropped first): GET it without stream",
                param="stream",
            )
        return event_stream(entry.events, cursor(entry.events, starting_after))

    @router.delete("/responses/{response_id}")
    async def delete(response_id: str) -> DeletedResponse:
        store.delete(response_id)
        return DeletedResponse(id=response_id)

    @router.post("/responses/{response_id}/cancel", response_model=Response)
    async def cancel(response_id: str) -> JSONResponse:
        return JSONResponse(cancel_background(store, response_id))

    @router.get("/responses/{response_id}/input_items")
    async def list_input_items(
        response_id: str,
        limit: int = Query(default=20, ge=1, le=MAX_LIST_LIMIT),
        order: Literal["asc", "desc"] = "desc",
        after: str | None = None,
    ) -> InputItemList:
        items = store.get(response_id).input_items
        ordered = items if order == "asc" else items[::-1]
        if after is not None:
            ids = [item["id"] for item in ordered]
            if after not in ids:
                raise APIError(404, f"response {response_id!r} has no input item {after!r}", param="after")
            ordered = ordered[ids.index(after) + 1 :]
        page = ordered[:limit]
        return InputItemList(
            data=page,
            first_id=page[0]["id"] if page else None,
            last_id=page[-1]["id"] if page else None,
            has_more=len(ordered) > limit,
        )

    return store


async def _create(ctx: ServerContext, store: ResponseStore, body: ResponsesRequest, request: Request) -> Any:
    if body.background:
        check_background(ctx, store, body)
    previous = (
        store.get(body.previous_response_id, param="previous_response_id")
        if body.previous_response_id is not None
        else None
    )
    if previous is not None and previous.response["status"] in PENDING:
        raise APIError(
            400,
            f"previous response {body.previous_response_id!r} is a background response still running: its "
            "output is not known yet (poll GET /v1/responses/{id} until it finishes)",
            param="previous_response_id",
        )
    context = previous.context if previous is not None else []
    items = input_items(body.input)
    chat = chat_request(body, context=context, items=items)
    lora_request = resolve_model(ctx, body.model)  # run_chat resolves it again; here for the answer's model
    model = lora_request.lora_name if lora_request is not None else ctx.model_name
    head = response_head(body, response_id=new_id("resp"), model=model)

    def remember(response: dict[str, Any]) -> None:
        if body.store:
            entry = StoredResponse(
                response=response, input_items=items, context=[*context, *items, *response["output"]]
            )
            store.put(entry)

    def rewrite(call: Call, started: list[Started], chunks: ChunkStream) -> ChunkStream:
        return response_events(chunks, head=head, cached_tokens=cached_tokens(started), on_done=remember)

    if body.background:
        request.state.request_id = head["id"]  # the POST's log line names the response it queued
        await check_prepared(ctx, chat)
        queued = response_object(head, status="queued").model_dump()
        log = EventLog() if body.stream else None
        entry = StoredResponse(
            response=queued, input_items=items, context=[*context, *items], streamed=body.stream, events=log
        )
        background = detached(request, head["id"])

        async def work() -> dict[str, Any]:
            if log is None:
                answer = await run_chat(ctx, background, chat, request_id=head["id"])
                assert isinstance(answer, ChatAnswer)  # not streamed
                return _response(head, answer)
            recording = Recording(store, entry, head)
            answer = await run_chat(ctx, background, chat, request_id=head["id"], rewrite=recording.rewrite)
            return await recording.drain(answer)

        if log is not None:
            for event in queued_events(queued):
                log.append(event)
        start_background(ctx.lifecycle, store, entry, work)
        return JSONResponse(queued) if log is None else event_stream(log, -1)
    answer = await run_chat(ctx, request, chat, request_id=head["id"], rewrite=rewrite)
    if isinstance(answer, StreamingResponse):
        return answer
    response = _response(head, answer)
    remember(response)
    return JSONResponse(response)


def _response(head: dict[str, Any], answer: ChatAnswer) -> dict[str, Any]:
    """The finished Response object of a plain (not streamed) answer."""
    choice, usage = answer.completion.choices[0], answer.completion.usage
    details = usage.completion_tokens_details
    output, status = from_choice(choice, reasoning_tokens=details.reasoning_tokens if details else 0)
    return response_object(
        head,
        status=status,
        output=output,
        usage=usage_of(usage.model_dump(), cached_tokens(answer.started)),
        structured=choice.structured,
    ).model_dump()
