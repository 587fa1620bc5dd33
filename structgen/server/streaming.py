"""Server-Sent Events: chat and text completion chunks from the engine's deltas.

A client that goes away cancels the stream, which aborts the engine requests and frees their KV blocks. A
stream that cannot finish (engine failure, aborted by shutdown) ends with an OpenAI error event, then `[DONE]`.
The Responses API frames its typed events differently (`named`): each under an `event:` line, and no `[DONE]`.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from fastapi.responses import StreamingResponse
from starlette.background import BackgroundTask

from structgen.engine.outputs import CompletionOutput
from structgen.server import answers as a
from structgen.server.echo import Echo
from structgen.server.errors import APIError, error_body
from structgen.server.generation import Call, Started, outputs, prompt_tokens
from structgen.server.logprobs_body import SampledOffsets, chat_logprobs, completion_logprobs

_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def sse(events: AsyncIterator[dict[str, Any]], call: Call, *, named: bool = False) -> StreamingResponse:
    """The SSE response of `events`. `named`: typed events (a `type` field each, as the Responses API sends them)
    go out under `event: <type>` lines and the stream just ends, as OpenAI's does (no `[DONE]`); such a stream
    reports its own errors as events, in its own shape."""

    async def body() -> AsyncIterator[str]:
        try:
            async for event in events:
                data = json.dumps(event, ensure_ascii=False, separators=(",", ":"))
                yield f"event: {event['type']}\ndata: {data}\n\n" if named else f"data: {data}\n\n"
        except APIError as error:
            event = error_body(error.status, error.message, param=error.param, code=error.code)
            yield f"data: {json.dumps(event)}\n\n"
        finally:
            call.ticket.close()
        if not named:
            yield "data: [DONE]\n\n"

    # The background task closes the ticket even when the body never started (client gone at once).
    return StreamingResponse(
        body(),
        media_type="text/event-stream",
        headers=_SSE_HEADERS,
        background=BackgroundTask(call.ticket.close),
    )


async def _choice_outputs(
    call: Call, started: list[Started], n: int
) -> AsyncIterator[tuple[int, CompletionOutput]]:
    """(choice index, output with its delta) for every new piece of every choice; raises the error of a failed
    output, and at the end the error of outputs that never finished (aborted)."""
    finished: set[int] = set()
    async for i, output in outputs(started):
        for o in output.outputs:
            if o.finish_reason == "error":
                raise APIError(400, o.error or "the request failed", code="generation_error")
            if o.finished:
                finished.add(i * n + o.index)
            yield i * n + o.index, o
    if len(finished) < n * len(started):
        raise call.missing_error()


async def chat_chunks(
    call: Call, started: list[Started], n: int, include_usage: bool, *, include_reasoning: bool = True
) -> AsyncIterator[dict[str, Any]]:
    """Chat chunks: the role, then each choice's deltas, its finish, and the usage last when asked for. A
    reasoning delta goes out in a chunk of its own, before the answer's from the same step: the tool-call parser
    (`ChatTools.events`) reads content chunks only and passes it on untouched. `include_reasoning=False` leaves
    the reasoning out."""

    def chunk(
        index: int,
        delta: a.ChatDelta,
        finish_reason: str | None = None,
        logprobs: dict[str, Any] | None = None,
        structured: a.StructuredInfo | None = None,
    ) -> dict[str, Any]:
        choice = a.ChatChunkChoice(
            index=index, delta=delta, finish_reason=finish_reason, logprobs=logprobs, structured=structured
        )
        return _lean(
            a.ChatCompletionChunk(
                id=call.id, created=call.created, model=call.model, choices=[choice]
            ).model_dump()
        )

    for index in range(n * len(started)):
        yield chunk(index, a.ChatDelta(role="assistant", content=""))
    finals: dict[int, CompletionOutput] = {}
    sent: dict[int, int] = {}  # logprob entries already sent, per choice
    async for index, o in _choice_outputs(call, started, n):
        if o.finished:
            finals[index] = o
        reasoning = o.delta_reasoning if include_reasoning else ""
        if reasoning or o.delta_text:
            start = sent.get(index, 0)
            thinking, answer = _new_logprobs(o, start, apart=include_reasoning)
            # The reasoning tokens' logprobs go with the reasoning (on an empty delta where the step has no
            # reasoning text, as for `</think>`), the answer's with its text; the Responses API reads the latter
            # only. Entries of an answer whose text is still held back wait for it.
            if reasoning or thinking:
                delta = (
                    a.ChatDelta(reasoning=reasoning, reasoning_content=reasoning)
                    if reasoning
                    else a.ChatDelta()
                )
                yield chunk(index, delta, logprobs=_chat_logprobs(call, thinking))
            sent[index] = start + len(thinking or ())
            if o.delta_text:
                yield chunk(index, a.ChatDelta(content=o.delta_text), logprobs=_chat_logprobs(call, answer))
                sent[index] += len(answer or ())
        if o.finished:
            rest = o.logprobs[sent.get(index, 0) :] if o.logprobs is not None else []
            logprobs = chat_logprobs(call.tokenizer, rest) if rest else None
            yield chunk(
                index, a.ChatDelta(), o.finish_reason, logprobs=logprobs, structured=a.StructuredInfo.of(o)
            )
    usage = call.finish(prompt_tokens(started), list(finals.values()))
    if include_usage:
        yield a.ChatCompletionChunk(
            id=call.id, created=call.created, model=call.model, choices=[], usage=usage
        ).model_dump()


def _new_logprobs(
    o: CompletionOutput, start: int, *, apart: bool
) -> tuple[list[Any] | None, list[Any] | None]:
    """The logprob entries since `start` (None when not asked for): the reasoning tokens', then the answer's.
    While the output reasons `num_reasoning_tokens` counts every token so far; `apart=False`: all are the
    answer's."""
    if o.logprobs is None:
        return None, None
    boundary = max(start, min(o.num_reasoning_tokens, len(o.logprobs))) if apart else start
    return o.logprobs[start:boundary], o.logprobs[boundary:]


def _chat_logprobs(call: Call, entries: list[Any] | None) -> dict[str, Any] | None:
    return chat_logprobs(call.tokenizer, entries) if entries is not None else None


async def completion_chunks(
    call: Call,
    started: list[Started],
    n: int,
    include_usage: bool,
    echo: Echo | None = None,
    *,
    skip_special_tokens: bool = True,
) -> AsyncIterator[dict[str, Any]]:
    """Text completion chunks; with `echo` each choice starts with a chunk of its prompt (and the prompt's
    logprobs), and the offsets of its sampled tokens' logprobs count from after the prompt's text. A token's
    entry goes out once its place in the text is settled (`SampledOffsets`): a token whose text the engine
    still holds back (a stop string's possible start) waits, so the offsets are those of the plain answer."""

    def chunk(
        index: int,
        text: str,
        logprobs: Any = None,
        finish_reason: str | None = None,
        structured: a.StructuredInfo | None = None,
    ) -> dict[str, Any]:
        choice = a.CompletionChoice(
            index=index, text=text, logprobs=logprobs, finish_reason=finish_reason, structured=structured
        )
        return _lean(
            a.Completion(id=call.id, created=call.created, model=call.model, choices=[choice]).model_dump(
                exclude={"usage"}
            )
        )

    for index in range(n * len(started)) if echo is not None else ():
        yield chunk(index, echo.text(index), echo.prompt_logprobs(index))
    finals: dict[int, CompletionOutput] = {}
    offsets: dict[int, SampledOffsets] = {}  # per choice: its tokens' places
    sent: dict[int, int] = {}  # logprob entries already sent, per choice
    async for index, o in _choice_outputs(call, started, n):
        if echo is not None:
            o = echo.output(o)
        if o.finished:
            finals[index] = o
        if o.delta_text or o.finished:
            logprobs = None
            if o.logprobs is not None:
                places = offsets.get(index)
                if places is None:
                    after = len(echo.text(index)) if echo is not None else 0
                    places = offsets[index] = SampledOffsets(
                        call.tokenizer, start=after, skip_special_tokens=skip_special_tokens
                    )
                start = sent.get(index, 0)
                places.push(e.token_id for e in o.logprobs[len(places) :])
                settled = places.settled(o.text, since=start, finished=o.finished)
                logprobs = completion_logprobs(
                    call.tokenizer, o.logprobs[start : start + len(settled)], settled
                )
                sent[index] = start + len(settled)
            structured = a.StructuredInfo.of(o) if o.finished else None
            yield chunk(index, o.delta_text, logprobs, o.finish_reason, structured)
    usage = call.finish(prompt_tokens(started), list(finals.values()))
    if include_usage:
        yield a.Completion(
            id=call.id, created=call.created, model=call.model, choices=[], usage=usage
        ).model_dump()


def _lean(event: dict[str, Any]) -> dict[str, Any]:
    """The chunk without a `structured: null` key: it is sent once, with a structured choice's finish_reason,
    and a null on every other chunk would only add bytes to each. The same for a chat delta's null reasoning
    keys (vLLM sends them only with reasoning, and clients read them with a default)."""
    for choice in event["choices"]:
        if choice.get("structured", 0) is None:
            del choice["structured"]
        delta = choice.get("delta")
        for key in ("reasoning", "reasoning_content"):
            if delta is not None and delta.get(key, 0) is None:
                del delta[key]
    return event
