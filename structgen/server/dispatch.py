"""One generation request from admission to its answer: a stream of events, or the finished outputs.

The ticket (in-flight tracking, admission control) is held until the answer ends: past the stream's last event,
or once the outputs are collected. A client that leaves before its stream starts, or while it waits for a plain
answer, cancels the work, which aborts its engine requests.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import StreamingResponse

from structgen.engine.outputs import CompletionOutput
from structgen.lora import LoRARequest
from structgen.sampling_params import SamplingParams
from structgen.server.context import ServerContext
from structgen.server.generation import Call, Started, collect, start, unless_disconnected
from structgen.server.streaming import sse

# Builds the SSE events of a started request.
EventsFactory = Callable[[Call, list[Started]], AsyncIterator[dict[str, Any]]]


@dataclass(slots=True)
class Finished:
    call: Call
    started: list[Started]
    outputs: list[CompletionOutput]  # prompt-major, `n` per prompt
    prompt_tokens: int


async def dispatch(
    ctx: ServerContext,
    request: Request,
    request_id: str,
    prompts: list[Any],
    params: SamplingParams,
    *,
    events: EventsFactory | None,
    named_events: bool = False,
    reasoning: bool = True,
    lora_request: LoRARequest | None = None,
) -> StreamingResponse | Finished:
    """With `events` the SSE response (the request is started, so early errors are still plain 4xx; `named_events`
    frames them as the Responses API does, see `streaming.sse`); without, the finished outputs. `reasoning=False`
    turns the engine's reasoning phase off for these prompts (raw text completions). `lora_request`: the
    adapter the request named (`routes_models.resolve_model`), which its answers report as their model."""
    request.state.request_id = request_id
    ticket = ctx.lifecycle.open()
    model = lora_request.lora_name if lora_request is not None else ctx.model_name
    call = Call(ctx, request_id, request, ticket, model=model)
    try:
        # A client that leaves while its request still waits for a first token aborts it too.
        # A plain answer needs no per-step outputs: only the first (it runs) and the finished one.
        started = await unless_disconnected(
            request,
            start(
                ctx,
                ticket,
                prompts,
                params,
                request_id,
                stream=events is not None,
                reasoning=reasoning,
                lora_request=lora_request,
            ),
        )
        if events is not None:
            return sse(events(call, started), call, named=named_events)
        outputs, prompt_tokens = await unless_disconnected(request, collect(call, started, params.n))
    except BaseException:
        ticket.close()
        raise
    ticket.close()
    return Finished(call, started, outputs, prompt_tokens)
