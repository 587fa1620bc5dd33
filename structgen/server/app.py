"""The FastAPI app: OpenAI's `/v1/models`, `/v1/chat/completions` and `/v1/completions` over an `AsyncEngine`.

A request is started (and its first output awaited) before any response bytes go out, so everything the engine
rejects up front (prompt too long, a schema it cannot enforce) is still an ordinary 400. Streams are Server-Sent
Events; a client that goes away cancels the stream, which aborts the engine request and frees its KV blocks.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from structgen.engine.async_engine import AsyncEngine, EngineDeadError
from structgen.engine.outputs import CompletionOutput, RequestOutput
from structgen.sampling_params import SamplingParams
from structgen.server import protocol as p
from structgen.server.errors import APIError, error_body, install_error_handlers

logger = logging.getLogger("structgen.server")

_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def build_app(engine: AsyncEngine, tokenizer: Any, *, model_name: str, api_key: str | None = None) -> FastAPI:
    """The OpenAI-compatible app serving `engine` under `model_name`. With `api_key`, `/v1/*` needs
    `Authorization: Bearer <api_key>`; `/health` stays open."""
    app = FastAPI(title="structgen", docs_url=None, redoc_url=None, openapi_url=None)
    install_error_handlers(app)
    app.add_middleware(_RequestLog)

    @app.get("/health")
    async def health() -> JSONResponse:
        if not engine.is_running:
            return JSONResponse(error_body(503, "the engine is not running"), status_code=503)
        return JSONResponse({"status": "ok"})

    router = APIRouter(prefix="/v1", dependencies=[Depends(_auth(api_key))])

    @router.get("/models")
    async def models() -> p.ModelList:
        return p.ModelList(data=[p.ModelCard(id=model_name)])

    @router.post("/chat/completions", response_model=None)
    async def chat(body: p.ChatCompletionRequest, request: Request) -> Any:
        _check_model(body.model, model_name)
        params = body.to_sampling_params()
        messages = [m.for_template() for m in body.messages]
        try:
            text = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        except Exception as error:  # a template that rejects the conversation (roles out of order...)
            raise APIError(400, f"cannot apply the chat template: {error}", param="messages") from None
        prompt = {"prompt": text, "prompt_token_ids": tokenizer.encode(text, add_special_tokens=False)}
        request_id = p.new_id("chatcmpl")
        request.state.request_id = request_id
        streams = await _start(engine, [prompt], params, request_id)
        call = _Call(request_id, model_name, request, tokenizer)
        if body.stream:
            include_usage = body.stream_options is not None and body.stream_options.include_usage
            return _sse(_chat_chunks(call, streams, params.n, include_usage))
        finals, prompt_tokens = await _collect(streams, params.n)
        choices = [
            p.ChatChoice(
                index=i,
                message=p.AssistantMessage(content=o.text),
                logprobs=p.chat_logprobs(tokenizer, o.logprobs) if o.logprobs is not None else None,
                finish_reason=o.finish_reason,
            )
            for i, o in enumerate(finals)
        ]
        return p.ChatCompletion(
            id=request_id,
            created=call.created,
            model=model_name,
            choices=choices,
            usage=call.usage(prompt_tokens, finals),
        )

    @router.post("/completions", response_model=None)
    async def completions(body: p.CompletionRequest, request: Request) -> Any:
        _check_model(body.model, model_name)
        params = body.to_sampling_params()
        request_id = p.new_id("cmpl")
        request.state.request_id = request_id
        streams = await _start(engine, body.prompts(), params, request_id)
        call = _Call(request_id, model_name, request, tokenizer)
        if body.stream:
            include_usage = body.stream_options is not None and body.stream_options.include_usage
            return _sse(_completion_chunks(call, streams, params.n, include_usage))
        finals, prompt_tokens = await _collect(streams, params.n)
        choices = [
            p.CompletionChoice(
                index=i,
                text=o.text,
                logprobs=p.completion_logprobs(tokenizer, o.logprobs) if o.logprobs is not None else None,
                finish_reason=o.finish_reason,
            )
            for i, o in enumerate(finals)
        ]
        return p.Completion(
            id=request_id,
            created=call.created,
            model=model_name,
            choices=choices,
            usage=call.usage(prompt_tokens, finals),
        )

    app.include_router(router)
    return app


# -- request plumbing -----------------------------------------------------------------------------------------


def _auth(api_key: str | None) -> Callable[[Request], None]:
    expected = f"Bearer {api_key}".encode() if api_key else None

    def check(request: Request) -> None:
        if expected is None:
            return
        given = request.headers.get("authorization", "").encode()
        if not hmac.compare_digest(given, expected):  # constant time: no key prefix leaks through timing
            raise APIError(
                401, "invalid or missing API key (send 'Authorization: Bearer <key>')", code="invalid_api_key"
            )

    return check


def _check_model(requested: str | None, served: str) -> None:
    if requested is not None and requested != served:
        raise APIError(
            404,
            f"the model {requested!r} does not exist; this server serves {served!r}",
            param="model",
            code="model_not_found",
        )


class _Call:
    """What every response of one HTTP request shares."""

    def __init__(self, request_id: str, model: str, request: Request, tokenizer: Any) -> None:
        self.id = request_id
        self.tokenizer = tokenizer
        self.model = model
        self.created = int(time.time())
        self.state = request.state

    def usage(self, prompt_tokens: int, finals: list[CompletionOutput]) -> p.Usage:
        completion_tokens = sum(len(o.token_ids) for o in finals)
        self.state.usage = (prompt_tokens, completion_tokens)
        return p.Usage(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
        )


# A started request: its iterator and the first output it produced.
_Started = tuple[AsyncIterator[RequestOutput], RequestOutput]


async def _start(
    engine: AsyncEngine, prompts: list[Any], params: SamplingParams, request_id: str
) -> list[_Started]:
    """Add one engine request per prompt and wait for each one's first output; errors become 400 / 503."""
    started: list[_Started] = []
    try:
        for i, prompt in enumerate(prompts):
            stream = engine.generate(
                prompt, params, request_id=request_id if len(prompts) == 1 else f"{request_id}-{i}"
            )
            started.append((stream, await _first(stream)))
            _raise_failed(started[-1][1].outputs)
    except BaseException:
        for stream, _ in started:
            await stream.aclose()  # type: ignore[attr-defined]
        raise
    return started


async def _first(stream: AsyncIterator[RequestOutput]) -> RequestOutput:
    from structgen.structured import CompileTimeoutError, StructuredOutputError, UnsupportedSchemaError

    try:
        return await anext(stream)
    except StopAsyncIteration:
        raise APIError(503, "the request was aborted before it produced output") from None
    except UnsupportedSchemaError as error:
        raise APIError(400, str(error), param="response_format", code="unsupported_schema") from None
    except CompileTimeoutError as error:
        raise APIError(400, str(error), param="response_format", code="compile_timeout") from None
    except (StructuredOutputError, ValueError) as error:  # prompt too long, n over max_num_seqs, bad spec
        raise APIError(400, str(error), code="invalid_request") from None
    except EngineDeadError as error:
        raise APIError(503, str(error), code="engine_dead") from None


def _raise_failed(outputs: list[CompletionOutput]) -> None:
    for output in outputs:
        if output.finish_reason == "error":
            code = "unsupported_schema" if output.structured is not None else "generation_error"
            raise APIError(400, output.error or "the request failed", param="response_format", code=code)


async def _outputs(started: list[_Started]) -> AsyncIterator[tuple[int, RequestOutput]]:
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


async def _collect(started: list[_Started], n: int) -> tuple[list[CompletionOutput], int]:
    """The finished outputs of every prompt (prompt-major, `n` each) and the total prompt tokens."""
    latest: dict[tuple[int, int], CompletionOutput] = {}
    async for i, output in _outputs(started):
        for o in output.outputs:
            latest[i, o.index] = o
    finals = [latest[i, j] for i in range(len(started)) for j in range(n)]
    _raise_failed(finals)
    return finals, sum(len(first.prompt_token_ids) for _, first in started)


def _sse(events: AsyncIterator[dict[str, Any]]) -> StreamingResponse:
    async def body() -> AsyncIterator[str]:
        async for event in events:
            yield f"data: {json.dumps(event, ensure_ascii=False, separators=(',', ':'))}\n\n"
        yield "data: [DONE]\n\n"

    return StreamingResponse(body(), media_type="text/event-stream", headers=_SSE_HEADERS)


async def _stream_outputs(started: list[_Started], n: int) -> AsyncIterator[tuple[int, CompletionOutput]]:
    """(choice index, output with its delta) for every new piece of every choice."""
    async for i, output in _outputs(started):
        for o in output.outputs:
            yield i * n + o.index, o


def _stream_error(o: CompletionOutput) -> dict[str, Any]:
    return error_body(400, o.error or "the request failed", code="generation_error")


async def _chat_chunks(
    call: _Call, started: list[_Started], n: int, include_usage: bool
) -> AsyncIterator[dict[str, Any]]:
    def chunk(
        index: int,
        delta: p.ChatDelta,
        finish_reason: str | None = None,
        logprobs: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        choice = p.ChatChunkChoice(index=index, delta=delta, finish_reason=finish_reason, logprobs=logprobs)
        return p.ChatCompletionChunk(
            id=call.id, created=call.created, model=call.model, choices=[choice]
        ).model_dump()

    for index in range(n * len(started)):
        yield chunk(index, p.ChatDelta(role="assistant", content=""))
    finals: dict[int, CompletionOutput] = {}
    sent: dict[int, int] = {}  # logprob entries already sent, per choice
    async for index, o in _stream_outputs(started, n):
        if o.finish_reason == "error":
            yield _stream_error(o)
            return
        if o.finished:
            finals[index] = o
        if o.delta_text:
            new = o.logprobs[sent.get(index, 0) :] if o.logprobs is not None else None
            sent[index] = len(o.logprobs or ())
            logprobs = p.chat_logprobs(call.tokenizer, new) if new is not None else None
            yield chunk(index, p.ChatDelta(content=o.delta_text), logprobs=logprobs)
        if o.finished:
            rest = o.logprobs[sent.get(index, 0) :] if o.logprobs is not None else []
            logprobs = p.chat_logprobs(call.tokenizer, rest) if rest else None
            yield chunk(index, p.ChatDelta(), o.finish_reason, logprobs=logprobs)
    usage = call.usage(sum(len(f.prompt_token_ids) for _, f in started), list(finals.values()))
    if include_usage:
        yield p.ChatCompletionChunk(
            id=call.id, created=call.created, model=call.model, choices=[], usage=usage
        ).model_dump()


async def _completion_chunks(
    call: _Call, started: list[_Started], n: int, include_usage: bool
) -> AsyncIterator[dict[str, Any]]:
    finals: dict[int, CompletionOutput] = {}
    sent: dict[int, int] = {}  # logprob entries already sent, per choice
    async for index, o in _stream_outputs(started, n):
        if o.finish_reason == "error":
            yield _stream_error(o)
            return
        if o.finished:
            finals[index] = o
        if o.delta_text or o.finished:
            logprobs = None
            if (
                o.logprobs is not None
            ):  # the tokens since the last chunk (a partial character waits for its end)
                start = sent.get(index, 0)
                offset = len(o.text) - len(o.delta_text)
                logprobs = p.completion_logprobs(call.tokenizer, o.logprobs[start:], offset=offset)
                sent[index] = len(o.logprobs)
            choice = p.CompletionChoice(
                index=index, text=o.delta_text, logprobs=logprobs, finish_reason=o.finish_reason
            )
            yield p.Completion(
                id=call.id, created=call.created, model=call.model, choices=[choice]
            ).model_dump(exclude={"usage"})
    usage = call.usage(sum(len(f.prompt_token_ids) for _, f in started), list(finals.values()))
    if include_usage:
        yield p.Completion(
            id=call.id, created=call.created, model=call.model, choices=[], usage=usage
        ).model_dump()


class _RequestLog:
    """Pure ASGI middleware: one log line per HTTP request, written when the response (stream included) ends."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status = 500
        state = scope.setdefault("state", {})

        async def send_and_note(message: dict[str, Any]) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_and_note)
        finally:
            usage = state.get("usage")
            tokens = f" prompt_tokens={usage[0]} completion_tokens={usage[1]}" if usage else ""
            logger.info(
                "%s %s %s %d%s %.1f ms",
                state.get("request_id", "-"),
                scope["method"],
                scope["path"],
                status,
                tokens,
                (time.perf_counter() - start) * 1000,
            )
