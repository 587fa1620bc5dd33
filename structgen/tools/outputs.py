"""Finished outputs of tool-calling requests: a `CompletionOutput` that also carries the parsed calls."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, fields

from structgen.engine.outputs import CompletionOutput, RequestOutput
from structgen.tools.parser import ParsedOutput, ToolCall


@dataclass(slots=True)
class ToolCompletionOutput(CompletionOutput):
    """`content`: the text before the calls (None when the output is only calls); `tool_calls`: the parsed
    calls (OpenAI shape via `ToolCall.to_openai()`); `finish_reason` is "tool_calls" when calls were made."""

    content: str | None = None
    tool_calls: list[ToolCall] = field(default_factory=list)

    @classmethod
    def from_output(cls, output: CompletionOutput, parsed: ParsedOutput) -> ToolCompletionOutput:
        values = {f.name: getattr(output, f.name) for f in fields(CompletionOutput)}
        values["finish_reason"] = finish_reason(parsed, output.finish_reason)
        return cls(**values, content=parsed.content, tool_calls=parsed.calls)


def finish_reason(parsed: ParsedOutput, finish_reason: str | None) -> str | None:
    """OpenAI's finish reason: a call block that ended normally is "tool_calls"."""
    return "tool_calls" if parsed.calls and finish_reason == "stop" else finish_reason


def with_tool_calls(result: RequestOutput, parse: Callable[[str], ParsedOutput]) -> RequestOutput:
    """`result` with each finished output replaced by a `ToolCompletionOutput` (`parse`: text → ParsedOutput)."""
    result.outputs = [
        ToolCompletionOutput.from_output(o, parse(o.text)) if o.finished else o for o in result.outputs
    ]
    return result
