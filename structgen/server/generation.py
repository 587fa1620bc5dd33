"""From an HTTP request to engine requests and back: start them, merge their outputs, collect the finals.

A request is started (and its first output awaited) before any response bytes go out, so everything the engine
rejects up front (prompt too long, a schema it cannot enforce) is still an ordinary 400.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Iterator
from typing import Any, TypeVar

from fastapi import Request

from structgen.engine.async_engine import EngineDeadError
from structgen.engine.outputs import CompletionOutput, RequestOutput, TokenLogprob
from structgen.lora import LoRAError, LoRARequest
from structgen.sampling_params import SamplingParams
from structgen.server import answers as a
from structgen.server.context import ServerContext
from structgen.server.errors import APIError
from structgen.server.lifecycle import Ticket

T = TypeVar("T")

# A started request: its iterator and the first output it produced.
Started = tuple[AsyncIterator[RequestOutput], RequestOutput]


class Call:
    """What every response of one HTTP request shares; `model` is what the answers report (the base model's name,
    or the LoRA adapter the request named)."""

    def __init__(
        self, ctx: ServerContext, request_id: str, request: Request, ticket: Ticket, *, model: str
    ) -> None:
        self.ctx = ctx
        self.id = request_id
        self.tokenizer = ctx.tokenizer
        self.model = model
        self.created = int(time.time())
        self.state = request.state
        self.ticket = ticket
        # An engine with a reasoning parser reports the tokens spent reasoning in every usage.
        self.reports_reasoning = getattr(ctx.engine.engine, "reasoning_parser", None) is not None

    def finish(self, prompt_tokens: int, finals: list[CompletionOutput]) -> a.Usage:
        """The usage of the finished outputs; notes them for the request log and the metrics."""
        completion_tokens = sum(len(o.token_ids) for o in finals)
        self.state.usage = (prompt_tokens, completion_tokens)
        self.ctx.metrics.observe_outputs(finals)
        details = None
        if self.reports_reasoning:
            reasoning_tokens = sum(o.num_reasoning_tokens for o in finals)
            details = a.CompletionTokensDetails(reasoning_tokens=reasoning_tokens)
        return a.Usage(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
            completion_tokens_details=details,
        )

    def missing_error(self) -> APIError:
        """The error for outputs that ended without finishing (aborted in the engine)."""
        if self.ticket.aborted_by_shutdown:
            return APIError(503, "the server shut down before the request finished", code="shutting_down")
        return APIError(503, "the request was aborted before it finished", code="aborted")


async def start(
    ctx: ServerContext,
    ticket: Ticket,
    prompts: list[Any],
    params: SamplingParams,
    request_id: str,
    *,
    stream: bool = True,
    reasoning: bool = True,
    lora_request: LoRARequest | None = None,
) -> list[Started]:
    """Add one engine request per prompt and wait for each one's first output; errors become 400 / 503.
    `stream=False` (a plain answer): after the first output, only the finished one comes. `reasoning=False`:
    no reasoning phase even where the engine has a reasoning parser (`AsyncEngine.generate`). `lora_request`:
    every prompt runs with that adapter."""
    started: list[Started] = []
    try:
        for i, prompt in enumerate(prompts):
            rid = request_id if len(prompts) == 1 else f"{request_id}-{i}"
            with ticket.queued(rid):
                stream_of = ctx.engine.generate(
                    prompt,
                    params,
                    request_id=rid,
                    stream=stream,
                    reasoning=reasoning,
                    lora_request=lora_request,
                )
                started.append((stream_of, await _first(stream_of, ticket)))
            raise_failed(started[-1][1].outputs)
    except BaseException:
        for opened, _ in started:
            await opened.aclose()  # type: ignore[attr-defined]
        raise
    return started


async def _first(stream: AsyncIterator[RequestOutput], ticket: Ticket) -> RequestOutput:
    with start_errors():
        try:
            return await anext(stream)
        except StopAsyncIteration:
            if ticket.aborted_by_shutdown:
                raise APIError(
                    503, "the server shut down before the request started", code="shutting_down"
                ) from None
            raise APIError(503, "the request was aborted before it produced output") from None


@contextlib.contextmanager
def start_errors() -> Iterator[None]:
    """What the engine refuses a request for as it starts (its grammar, its adapter, its size), as the 400 / 503
    it is answered with."""
    from structgen.structured import (
        CompileBusyError,
        CompileTimeoutError,
        StructuredOutputError,
        UnsupportedSchemaError,
    )

    try:
        yield
    except UnsupportedSchemaError as error:
        raise APIError(400, str(error), param="response_format", code="unsupported_schema") from None
    except CompileTimeoutError as error:
        raise APIError(400, str(error), param="response_format", code="compile_timeout") from None
    except CompileBusyError as error:  # earlier compiles still hold the workers: not this request's fault
        raise APIError(503, str(error), code="compile_busy", headers={"Retry-After": "5"}) from None
    except LoRAError as error:  # the adapter was unloaded after the request named it
        code = "model_not_found" if error.status == 404 else "invalid_request"
        raise APIError(error.status, str(error), param="model", code=code) from None
    except (StructuredOutputError, ValueError) as error:  # prompt too long, n over max_num_seqs, bad spec
        raise APIError(400, str(error), code="invalid_request") from None
    except EngineDeadError as error:
        raise APIError(503, str(error), code="engine_dead") from None


def raise_failed(outputs: list[CompletionOutput]) -> None:
    for output in outputs:
        if output.finish_reason == "error":
            message = output.error or "the request failed"
            fallback = "unsupported_schema" if output.structured is not None else "generation_error"
            code = output.error_code or fallback
            raise APIError(400, message, param="response_format", code=code)


async def outputs(started: list[Started]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(prompt index, output) from every started request, as they come, beginning with the first outputs."""
    for i, (_, first) in enumerate(started):
        yield i, first
    queue: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue()

    async def pump(i: int, stream: AsyncIterator[RequestOutput], first: RequestOutput) -> None:
        try:
            if not first.finished:
                async for output in stream:
                    await queue.put((i, output))
        except Exception as error:
            await queue.put((i, error))
        await queue.put((i, None))

    tasks = [asyncio.create_task(pump(i, s, f)) for i, (s, f) in enumerate(started)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise APIError(503, f"the engine failed: {item}", code="engine_dead")
            else:
                yield i, item
    finally:
        # Cancelling a pump closes its engine iterator, which aborts the request (client gone, or an error).
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for stream, _ in started:
            await stream.aclose()  # type: ignore[attr-defined]


async def collect(call: Call, started: list[Started], n: int) -> tuple[list[CompletionOutput], int]:
    """The finished outputs of every prompt (prompt-major, `n` each) and the total prompt tokens."""
    latest: dict[tuple[int, int], CompletionOutput] = {}
    async for i, output in outputs(started):
        for o in output.outputs:
            latest[i, o.index] = o
    finals = [latest.get((i, j)) for i in range(len(started)) for j in range(n)]
    if any(o is None or not o.finished for o in finals):
        raise call.missing_error()
    raise_failed(finals)  # type: ignore[arg-type]
    return finals, prompt_tokens(started)  # type: ignore[return-value]


def prompt_tokens(started: list[Started]) -> int:
    return sum(len(first.prompt_token_ids) for _, first in started)


def scored_prompt(first: RequestOutput) -> list[TokenLogprob | None]:
    """The prompt's logprobs (`SamplingParams.prompt_logprobs`). The engine sets them on every output once the
    prompt has run, so on a request's first: it reports only after a step that produced a token."""
    if first.prompt_logprobs is None:
        raise APIError(500, "the engine returned no prompt logprobs", code="internal_error")
    return first.prompt_logprobs


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await `work`, cancelling it (which aborts its engine requests) if the client disconnects first."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
        await asyncio.gather(task, watcher, return_exceptions=True)
    if task.cancelled():
        raise APIError(499, "the client closed the request", code="client_closed")
    return task.result()


async def _disconnect(request: Request) -> None:
    # The body is read already, so the next message is the disconnect (uvicorn sends it when the client leaves).
    while (await request.receive())["type"] != "http.disconnect":
        pass
