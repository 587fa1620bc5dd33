"""`POST /v1/chat/completions`, and the chat pipeline behind it, which the Responses API runs too.

`run_chat` takes a `ChatCompletionRequest` through the whole way (model check, params, the prompt with its
tools (`chat_prompt`), the default output cap, dispatch, tool-call parsing) to a finished `ChatCompletion`, or
to the SSE response of its chunks. A route speaking another API (`server/responses/`) converts its body into a
`ChatCompletionRequest` and the answer back, and rewrites the chunk stream into its own events, instead of
copying the pipeline.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from structgen.engine.outputs import CompletionOutput
from structgen.server import answers as a
from structgen.server import protocol as p
from structgen.server.chat_prompt import chat_prompt
from structgen.server.context import ServerContext
from structgen.server.dispatch import Finished, dispatch
from structgen.server.generation import Call, Started, scored_prompt
from structgen.server.limits import with_default_max_tokens
from structgen.server.logprobs_body import chat_logprobs, vllm_prompt_logprobs
from structgen.server.openapi import generation_responses
from structgen.server.routes_models import resolve_model
from structgen.server.streaming import chat_chunks

ChunkStream = AsyncIterator[dict[str, Any]]
# Turns a started request's chat chunks (tool calls parsed, the usage chunk last when asked for) into the events
# another API streams instead.
ChunkRewriter = Callable[[Call, list[Started], ChunkStream], ChunkStream]


@dataclass(slots=True)
class ChatAnswer:
    """A finished chat request: the completion chat answers with, and what other APIs read beyond it."""

    completion: a.ChatCompletion
    started: list[Started]  # the first output of each engine request (prefix-cache hits, prompts)


def add_chat_route(router: APIRouter, ctx: ServerContext) -> None:
    @router.post("/chat/completions", response_model=None, responses=generation_responses(a.ChatCompletion))
    async def chat(body: p.ChatCompletionRequest, request: Request) -> Any:
        answer = await run_chat(ctx, request, body, request_id=p.new_id("chatcmpl"))
        return answer if isinstance(answer, StreamingResponse) else answer.completion


async def run_chat(
    ctx: ServerContext,
    request: Request,
    body: p.ChatCompletionRequest,
    *,
    request_id: str,
    rewrite: ChunkRewriter | None = None,
) -> StreamingResponse | ChatAnswer:
    """The chat pipeline: the finished answer, or with `body.stream` the SSE response of its chunks. `rewrite`
    replaces the chunks with another API's typed events, framed as named SSE events (`streaming.sse`)."""
    lora_request = resolve_model(ctx, body.model)
    params = body.to_sampling_params()
    prompt = chat_prompt(ctx.tokenizer, body, params)
    tools = prompt.tools
    run_params = tools.params
    if not body.max_tokens_given:  # never "until the context is full"
        run_params = with_default_max_tokens(
            run_params,
            default=ctx.limits.max_tokens_default,
            prompt_tokens=len(prompt.token_ids),
            max_sequence_tokens=ctx.engine.engine.max_sequence_tokens,
        )
    include_usage = body.stream_options is not None and body.stream_options.include_usage

    def events(call: Call, started: list[Started]) -> ChunkStream:
        chunks = chat_chunks(call, started, params.n, include_usage, include_reasoning=body.include_reasoning)
        chunks = tools.events(chunks)
        return chunks if rewrite is None else rewrite(call, started, chunks)

    result = await dispatch(
        ctx,
        request,
        request_id,
        [prompt.engine_prompt],
        run_params,
        events=events if body.stream else None,
        named_events=rewrite is not None,
        lora_request=lora_request,
    )
    if not isinstance(result, Finished):
        return result
    choices = [
        a.ChatChoice(
            index=i,
            message=with_reasoning(tools.message(o), o, include=body.include_reasoning),
            logprobs=chat_logprobs(ctx.tokenizer, o.logprobs) if o.logprobs is not None else None,
            finish_reason=tools.finish_reason(o),
            structured=a.StructuredInfo.of(o),
        )
        for i, o in enumerate(result.outputs)
    ]
    completion = a.ChatCompletion(
        id=result.call.id,
        created=result.call.created,
        model=result.call.model,
        choices=choices,
        usage=result.call.finish(result.prompt_tokens, result.outputs),
        prompt_logprobs=_prompt_logprobs(ctx, body, result.started),
    )
    return ChatAnswer(completion, result.started)


def _prompt_logprobs(
    ctx: ServerContext, body: p.ChatCompletionRequest, started: list[Started]
) -> a.PromptLogprobs | None:
    """vLLM's `prompt_logprobs` of the one prompt a chat request has (the rendered conversation)."""
    if body.prompt_logprobs is None:
        return None
    return vllm_prompt_logprobs(ctx.tokenizer, scored_prompt(started[0][1]), top=body.prompt_logprobs)


def with_reasoning(
    message: a.AssistantMessage, output: CompletionOutput, *, include: bool
) -> a.AssistantMessage:
    """`message` with the output's reasoning under both names (tool calls and content come from the answer
    alone: the engine keeps the reasoning out of `text`)."""
    if include and output.reasoning is not None:
        message.reasoning = message.reasoning_content = output.reasoning
    return message
