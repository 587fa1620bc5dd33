"""The chat route's tool calling: `tools` / `tool_choice` / `parallel_tool_calls` in, `message.tool_calls` and
streamed tool-call deltas out. The route calls `ChatTools.from_request` and asks it for the prompt messages,
the sampling params (constrained by the tool-call grammar), each choice's message, and the SSE events (the
plain chat chunks, rewritten: content deltas pass through the incremental parser)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from structgen.engine.outputs import CompletionOutput
from structgen.sampling_params import SamplingParams
from structgen.server import answers as a
from structgen.server import protocol as p
from structgen.server.errors import APIError
from structgen.tools import StreamingToolParser, ToolCallPlan, ToolError
from structgen.tools.outputs import finish_reason as tool_finish_reason


@dataclass(slots=True)
class ChatTools:
    """One chat request's view of tools; with `plan` None (no tools asked for) everything passes through."""

    plan: ToolCallPlan | None
    messages: list[dict[str, Any]]
    template_tools: list[dict[str, Any]] | None
    params: SamplingParams
    _parsers: dict[int, StreamingToolParser] = field(default_factory=dict)

    @classmethod
    def from_request(
        cls,
        body: p.ChatCompletionRequest,
        tokenizer: Any,
        messages: list[dict[str, Any]],
        params: SamplingParams,
    ) -> ChatTools:
        """Validate the request's tools (400 naming the problem) and prepare the prompt and params."""
        if body.tools is None and body.tool_choice is None:
            return cls(None, messages, None, params)
        try:
            plan = ToolCallPlan.build(
                body.tools,
                body.tool_choice,
                parallel_tool_calls=body.parallel_tool_calls,
                chat_template=tokenizer.chat_template,
            )
            params = plan.sampling_params(params, options=body.structured_options())
        except ToolError as error:
            raise APIError(400, str(error), param=error.param, code="invalid_tools") from None
        messages, template_tools = plan.conversation(messages)
        return cls(plan, messages, template_tools, params)

    def message(self, output: CompletionOutput) -> a.AssistantMessage:
        if self.plan is None:
            return a.AssistantMessage(content=output.text)
        parsed = self.plan.parse(output.text)
        if not parsed.calls:
            return a.AssistantMessage(content=output.text)
        return a.AssistantMessage(content=parsed.content, tool_calls=[c.to_openai() for c in parsed.calls])

    def finish_reason(self, output: CompletionOutput) -> str | None:
        if self.plan is None:
            return output.finish_reason
        return tool_finish_reason(self.plan.parse(output.text), output.finish_reason)

    async def events(self, chunks: AsyncIterator[dict[str, Any]]) -> AsyncIterator[dict[str, Any]]:
        """The chat chunks with each choice's content run through a tool-call parser."""
        async for chunk in chunks:
            if self.plan is None or not chunk.get("choices"):
                yield chunk
                continue
            choice = chunk["choices"][0]
            delta, finish = choice["delta"], choice.get("finish_reason")
            if delta.get("role") is not None or (not delta.get("content") and finish is None):
                yield chunk
                continue
            parser = self._parsers.setdefault(choice["index"], self.plan.stream_parser())
            if delta.get("content"):
                piece = parser.feed(delta["content"])
                if piece or choice.get("logprobs") is not None:
                    yield _with_delta(chunk, piece.content, piece.tool_calls, None)
            if finish is not None:
                rest, parsed = parser.finish()
                if rest:
                    yield _with_delta(chunk, rest.content, rest.tool_calls, None, logprobs=False)
                yield _with_delta(chunk, "", [], tool_finish_reason(parsed, finish))


def _with_delta(
    chunk: dict[str, Any],
    content: str,
    tool_calls: list[dict[str, Any]],
    finish_reason: str | None,
    *,
    logprobs: bool = True,
) -> dict[str, Any]:
    choice = chunk["choices"][0]
    delta = {"role": None, "content": content or None, "refusal": None, "tool_calls": tool_calls or None}
    new_choice = {
        **choice,
        "delta": delta,
        "finish_reason": finish_reason,
        "logprobs": choice.get("logprobs") if logprobs else None,
    }
    if finish_reason is None:  # the report rides on the chunk that finishes the choice only
        new_choice.pop("structured", None)
    return {**chunk, "choices": [new_choice]}
