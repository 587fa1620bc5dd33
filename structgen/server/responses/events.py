"""The Responses API's stream: chat chunks in, typed events out, in the order the `openai` SDK's accumulator
reads them.

`response.created`, `response.in_progress`; for the reasoning (with a reasoning parser) `response.output_item.added`,
`response.content_part.added`, `response.reasoning_text.delta`…, `response.reasoning_text.done`,
`response.content_part.done`, `response.output_item.done`; per message `response.output_item.added`,
`response.content_part.added`, `response.output_text.delta`…, `response.output_text.done`,
`response.content_part.done`, `response.output_item.done`; per function call `response.output_item.added`,
`response.function_call_arguments.delta`…, `response.function_call_arguments.done`,
`response.output_item.done`; then `response.completed` (or `response.incomplete` when the output budget cut
it). Every event carries its `sequence_number`. A generation that fails mid-stream ends with an `error` event
(OpenAI's shape: `code`, `message`, `param`), in the Responses API's terms.

A background stream (`background` with `stream`) starts as OpenAI's does, before its generation runs:
`response.created` and `response.queued`, both with the Response `queued` (`queued_events`); the generation's
events go on from `response.in_progress` once the engine runs it.
"""

from __future__ import annotations

import itertools
from collections.abc import AsyncIterator, Callable
from typing import Any

from structgen.server.errors import APIError
from structgen.server.responses.convert import responses_error
from structgen.server.responses.output import OutputItems, response_object, status_of, usage_of


def queued_events(queued: dict[str, Any]) -> list[dict[str, Any]]:
    """The first events of a background stream, sent as it is accepted: `queued` is its Response so far."""
    kinds = ("response.created", "response.queued")
    return [
        {"type": kind, "sequence_number": number, "response": queued} for number, kind in enumerate(kinds)
    ]


async def response_events(
    chunks: AsyncIterator[dict[str, Any]],
    *,
    head: dict[str, Any],
    cached_tokens: int,
    on_done: Callable[[dict[str, Any]], None],
    on_error: Callable[[APIError], None] | None = None,
    queued: bool = False,
) -> AsyncIterator[dict[str, Any]]:
    """The events of one response from its chat chunks (one choice, the usage chunk last). `on_done` gets the
    final Response object before `response.completed` goes out, so a client that reads that event can fetch the
    stored response at once; `on_error` the error an `error` event reports, before it goes out. `queued`: the
    stream's `queued_events` went out already; this goes on after them, from `response.in_progress`."""
    first = len(queued_events({})) if queued else 0
    numbers = itertools.count(first)

    def numbered(event: dict[str, Any]) -> dict[str, Any]:
        return {"type": event["type"], "sequence_number": next(numbers), **event}

    started = response_object(head, status="in_progress").model_dump()
    if not queued:
        yield numbered({"type": "response.created", "response": started})
    yield numbered({"type": "response.in_progress", "response": started})
    output = OutputItems()
    finish_reason: str | None = None
    structured: Any = None
    usage: dict[str, Any] = {}
    try:
        async for chunk in chunks:
            if not chunk["choices"]:  # the usage chunk
                usage = chunk["usage"]
                continue
            choice = chunk["choices"][0]
            delta = choice["delta"]
            events = []
            if delta.get("reasoning"):
                events += output.reasoning(delta["reasoning"])
            if delta.get("content"):
                events += output.text(delta["content"], (choice.get("logprobs") or {}).get("content"))
            for call in delta.get("tool_calls") or ():
                function = call.get("function") or {}
                if call.get("id") is not None:  # a call's first delta: its id and name
                    events += output.call(call["id"], function["name"])
                if function.get("arguments"):
                    events += output.arguments(function["arguments"])
            if choice.get("finish_reason") is not None:
                finish_reason = choice["finish_reason"]
                structured = choice.get("structured")
            for event in events:
                yield numbered(event)
    except APIError as error:
        error = responses_error(error)
        if on_error is not None:
            on_error(error)
        yield numbered({"type": "error", "code": error.code, "message": error.message, "param": error.param})
        return
    status = status_of(finish_reason)
    for event in output.finish(status):
        yield numbered(event)
    response = response_object(
        head,
        status=status,
        output=output.items,
        usage=usage_of(usage, cached_tokens),
        structured=structured,
    ).model_dump()
    on_done(response)
    yield numbered({"type": f"response.{status}", "response": response})
