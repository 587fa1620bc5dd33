"""`POST /v1/completions` (the legacy text completions API), `echo` included."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

from structgen.server import protocol as p
from structgen.server.context import ServerContext
from structgen.server.dispatch import Finished, dispatch
from structgen.server.generation import Call, Started
from structgen.server.logprobs_body import completion_logprobs
from structgen.server.openapi import generation_responses
from structgen.server.routes_models import resolve_model
from structgen.server.streaming import completion_chunks


def add_completions_route(router: APIRouter, ctx: ServerContext) -> None:
    @router.post("/completions", response_model=None, responses=generation_responses(p.Completion))
    async def completions(body: p.CompletionRequest, request: Request) -> Any:
        lora_request = resolve_model(ctx, body.model)
        params = body.to_sampling_params()
        include_usage = body.stream_options is not None and body.stream_options.include_usage

        def events(call: Call, started: list[Started]) -> Any:
            echo = _prompt_texts(ctx, started) if body.echo else None
            return completion_chunks(call, started, params.n, include_usage, echo)

        # A raw completion continues the prompt as it is: there is no chat turn for a reasoning phase to open, so
        # the engine's reasoning parser stays off (any grammar applies from the first token and the whole output
        # is `text`), as vLLM's completions have no reasoning split either.
        result = await dispatch(
            ctx,
            request,
            p.new_id("cmpl"),
            body.prompts(),
            params,
            events=events if body.stream else None,
            reasoning=False,
            lora_request=lora_request,
        )
        if not isinstance(result, Finished):
            return result
        echo = _prompt_texts(ctx, result.started) if body.echo else None
        choices = [
            p.CompletionChoice(
                index=i,
                text=(echo[i // params.n] if echo is not None else "") + o.text,
                logprobs=completion_logprobs(ctx.tokenizer, o.logprobs) if o.logprobs is not None else None,
                finish_reason=o.finish_reason,
                structured=p.StructuredInfo.of(o),
            )
            for i, o in enumerate(result.outputs)
        ]
        return p.Completion(
            id=result.call.id,
            created=result.call.created,
            model=result.call.model,
            choices=choices,
            usage=result.call.finish(result.prompt_tokens, result.outputs),
        )


def _prompt_texts(ctx: ServerContext, started: list[Started]) -> list[str]:
    """Each prompt as text (token prompts decoded), for `echo`."""
    return [
        first.prompt if first.prompt is not None else ctx.tokenizer.decode(first.prompt_token_ids)
        for _, first in started
    ]
