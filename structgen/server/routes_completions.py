"""`POST /v1/completions` (the legacy text completions API): `echo` (with the prompt's logprobs, and `max_tokens: 0`
to score a prompt, `echo.py`) and vLLM's `prompt_logprobs` included."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

from structgen.engine.outputs import CompletionOutput
from structgen.server import answers as a
from structgen.server import protocol as p
from structgen.server.context import ServerContext
from structgen.server.dispatch import Finished, dispatch
from structgen.server.echo import Echo
from structgen.server.generation import Call, Started, scored_prompt
from structgen.server.logprobs_body import (
    SampledOffsets,
    completion_logprobs,
    joined_completion_logprobs,
    vllm_prompt_logprobs,
)
from structgen.server.openapi import generation_responses
from structgen.server.routes_models import resolve_model
from structgen.server.streaming import completion_chunks


def add_completions_route(router: APIRouter, ctx: ServerContext) -> None:
    @router.post("/completions", response_model=None, responses=generation_responses(a.Completion))
    async def completions(body: p.CompletionRequest, request: Request) -> Any:
        lora_request = resolve_model(ctx, body.model)
        params = body.to_sampling_params()
        include_usage = body.stream_options is not None and body.stream_options.include_usage

        def events(call: Call, started: list[Started]) -> Any:
            echo = Echo.of(ctx.tokenizer, body, started, params.n)
            return completion_chunks(
                call, started, params.n, include_usage, echo, skip_special_tokens=params.skip_special_tokens
            )

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
        echo = Echo.of(ctx.tokenizer, body, result.started, params.n)
        outputs = [echo.output(o) for o in result.outputs] if echo is not None else result.outputs
        prompt_logprobs = [
            vllm_prompt_logprobs(ctx.tokenizer, scored_prompt(first), top=body.prompt_logprobs)
            if body.prompt_logprobs is not None
            else None
            for _, first in result.started
        ]
        choices = [
            a.CompletionChoice(
                index=i,
                text=(echo.text(i) if echo is not None else "") + o.text,
                logprobs=_logprobs(ctx, o, echo, i, skip_special_tokens=params.skip_special_tokens),
                finish_reason=o.finish_reason,
                structured=a.StructuredInfo.of(o),
                prompt_logprobs=prompt_logprobs[i // params.n],
            )
            for i, o in enumerate(outputs)
        ]
        return a.Completion(
            id=result.call.id,
            created=result.call.created,
            model=result.call.model,
            choices=choices,
            usage=result.call.finish(result.prompt_tokens, outputs),
        )


def _logprobs(
    ctx: ServerContext, output: CompletionOutput, echo: Echo | None, choice: int, *, skip_special_tokens: bool
) -> dict[str, Any] | None:
    """The choice's legacy `logprobs` object: the echoed prompt's tokens (offsets from the text's start), then
    the sampled ones (offsets in the sampled text, after the prompt's)."""
    if output.logprobs is None:
        return None
    start = len(echo.text(choice)) if echo is not None else 0
    offsets = SampledOffsets(ctx.tokenizer, start=start, skip_special_tokens=skip_special_tokens)
    offsets.push(e.token_id for e in output.logprobs)
    sampled = completion_logprobs(ctx.tokenizer, output.logprobs, offsets.settled(output.text))
    prompt = echo.prompt_logprobs(choice) if echo is not None else None
    return joined_completion_logprobs(prompt, sampled) if prompt is not None else sampled
