"""Tool calling: OpenAI `tools` / `tool_choice`, enforced by a grammar in the model's own tool-call format.

`ToolCallPlan.build(tools, tool_choice, parallel_tool_calls=..., chat_template=...)` validates a request and
gives the prompt messages, the `StructuredOutputsParams` constraining the output, and the parsers turning the
output text into OpenAI `tool_calls` (whole, or as streamed deltas).
"""

from structgen.tools.definitions import (
    ToolChoice,
    ToolDefinition,
    ToolError,
    parse_tool_choice,
    parse_tools,
)
from structgen.tools.formats import FORMATS, ToolCallFormat, detect_format, get_format
from structgen.tools.grammar import arguments_schema, tool_call_grammar
from structgen.tools.parser import ParsedOutput, ToolCall, parse_tool_calls
from structgen.tools.plan import ToolCallPlan
from structgen.tools.render import render_conversation, tools_system_text
from structgen.tools.streaming import StreamDelta, StreamingToolParser

__all__ = [
    "FORMATS",
    "ParsedOutput",
    "StreamDelta",
    "StreamingToolParser",
    "ToolCall",
    "ToolCallFormat",
    "ToolCallPlan",
    "ToolChoice",
    "ToolDefinition",
    "ToolError",
    "arguments_schema",
    "detect_format",
    "get_format",
    "parse_tool_calls",
    "parse_tool_choice",
    "parse_tools",
    "render_conversation",
    "tool_call_grammar",
    "tools_system_text",
]
