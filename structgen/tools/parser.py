"""Model output text → OpenAI `tool_calls` (and the text written before the calls, which is the `content`)."""

from __future__ import annotations

import json
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from structgen.tools.definitions import ToolDefinition
from structgen.tools.formats import ToolCallFormat

_DECODER = json.JSONDecoder()
_WHITESPACE = " \t\r\n"


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(slots=True)
class ToolCall:
    """One parsed call. `arguments` is the JSON text of the arguments object (what OpenAI sends); `error`
    says why it does not match the function's definition (None when it does)."""

    name: str
    arguments: str
    id: str = field(default_factory=new_call_id)
    error: str | None = None

    def parsed_arguments(self) -> Any:
        return json.loads(self.arguments)

    def to_openai(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


@dataclass(slots=True)
class ParsedOutput:
    """`content`: the text before the first call (None when empty and there are calls); `complete`: False
    when a block of calls was started but could not be read to its end (a truncated output)."""

    content: str | None
    calls: list[ToolCall]
    complete: bool = True

    @property
    def valid(self) -> bool:
        return self.complete and all(c.error is None for c in self.calls)


def parse_tool_calls(text: str, fmt: ToolCallFormat, tools: Sequence[ToolDefinition] = ()) -> ParsedOutput:
    """Read the calls in `text` written in `fmt`; with `tools`, each call is checked against its function."""
    start = text.find(fmt.trigger)
    if start < 0:
        return ParsedOutput(text, [])
    calls: list[ToolCall] = []
    pos = _expect(text, start, fmt.begin)
    complete = pos is not None
    while pos is not None:
        pos = _expect(text, pos, fmt.call_open)
        found = None if pos is None else _call_object(text, pos, fmt)
        if found is None:
            complete = False
            break
        call, pos = found
        calls.append(call)
        pos = _expect(text, pos, fmt.call_close)
        if pos is None:
            complete = False
            break
        if not _next_call(text, pos, fmt):
            complete = _expect(text, pos, fmt.end) is not None
            break
        pos = _expect(text, pos, fmt.separator)
    if not calls:
        return ParsedOutput(text, [], complete=False)
    by_name = {t.name: t for t in tools}
    if by_name:
        for call in calls:
            call.error = check_call(call, by_name)
    return ParsedOutput(text[:start] if text[:start].strip() else None, calls, complete)


def check_call(call: ToolCall, tools: dict[str, ToolDefinition]) -> str | None:
    """Why `call` does not fit its function's definition, or None."""
    from structgen.structured.validate import validate_instance

    tool = tools.get(call.name)
    if tool is None:
        return f"{call.name!r} is not one of the tools"
    result = validate_instance(json.loads(call.arguments), tool.parameters)
    return None if result.valid else f"arguments of {call.name!r}: {result.error}"


def _expect(text: str, pos: int, literal: str) -> int | None:
    """Position after `literal` at `pos`, whitespace around it tolerated (models outside a grammar vary)."""
    pos = _skip(text, pos)
    core = literal.strip()
    return pos + len(core) if text.startswith(core, pos) else None


def _next_call(text: str, pos: int, fmt: ToolCallFormat) -> bool:
    """Whether a separator and another call object follow `pos`."""
    after = _expect(text, pos, fmt.separator)
    opened = None if after is None else _expect(text, after, fmt.call_open)
    return opened is not None and text.startswith("{", _skip(text, opened))


def _skip(text: str, pos: int) -> int:
    while pos < len(text) and text[pos] in _WHITESPACE:
        pos += 1
    return pos


def _call_object(text: str, pos: int, fmt: ToolCallFormat) -> tuple[ToolCall, int] | None:
    try:
        value, end = _DECODER.raw_decode(text, _skip(text, pos))
    except json.JSONDecodeError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    # Models outside a grammar mix up the two names used for the arguments.
    key = next((k for k in (fmt.args_key, "arguments", "parameters") if k in value), None)
    arguments = {} if key is None else value[key]
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return None
    if not isinstance(arguments, dict):
        return None
    return ToolCall(value["name"], json.dumps(arguments, ensure_ascii=False)), end
