"""Incremental tool-call parsing for streamed outputs: text in, OpenAI deltas out.

Each `feed` re-reads the whole text so far (outputs are short; this keeps the parser free of a fragile state
machine) into a snapshot — the content written before the calls, and for each call its name once the name's
string is closed and the argument text written so far — and emits only what the snapshot adds to what was
already sent: content pieces, then per call one delta with `index`, `id`, `type` and `function.name`, then
`function.arguments` fragments. Text that could be the start of the trigger (`<tool_` before `<tool_call>`)
is held back until it is clearly content.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from structgen.tools.definitions import ToolDefinition
from structgen.tools.formats import ToolCallFormat
from structgen.tools.parser import ParsedOutput, new_call_id, parse_tool_calls

_NAME = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"')


@dataclass(slots=True)
class StreamDelta:
    """What one `feed` adds: a content piece and/or tool-call deltas (OpenAI chunk `delta.tool_calls` items)."""

    content: str = ""
    tool_calls: list[dict[str, Any]] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.content or self.tool_calls)


@dataclass(slots=True)
class _SentCall:
    id: str
    arguments: int = 0  # characters of the arguments already sent


class StreamingToolParser:
    """Feed the output's text deltas in order; `finish` returns the final parse (ids as streamed)."""

    def __init__(self, fmt: ToolCallFormat, tools: Sequence[ToolDefinition] = ()) -> None:
        self.fmt = fmt
        self.tools = list(tools)
        self.text = ""
        self._content_sent = 0
        self._calls: list[_SentCall] = []

    def feed(self, delta_text: str) -> StreamDelta:
        self.text += delta_text
        return self._emit(*self._snapshot(final=False))

    def finish(self) -> tuple[StreamDelta, ParsedOutput]:
        """Whatever is left to send, and the parse of the whole output."""
        parsed = parse_tool_calls(self.text, self.fmt, self.tools)
        if not parsed.calls:
            # No block of calls: all of it is content, the held-back tail included.
            rest = StreamDelta(content=self.text[self._content_sent :])
            self._content_sent = len(self.text)
            return rest, parsed
        rest = self._emit(*self._snapshot(final=True))
        for call, sent in zip(parsed.calls, self._calls, strict=False):
            call.id = sent.id
        return rest, parsed

    @property
    def has_calls(self) -> bool:
        return bool(self._calls)

    def _emit(self, content: str, calls: list[tuple[str | None, str]]) -> StreamDelta:
        out = StreamDelta(content=content[self._content_sent :])
        self._content_sent = max(self._content_sent, len(content))
        for index, (name, arguments) in enumerate(calls):
            if name is None:
                break
            if index == len(self._calls):
                self._calls.append(_SentCall(new_call_id()))
                out.tool_calls.append(
                    {
                        "index": index,
                        "id": self._calls[index].id,
                        "type": "function",
                        "function": {"name": name, "arguments": ""},
                    }
                )
            sent = self._calls[index]
            if len(arguments) > sent.arguments:
                piece = arguments[sent.arguments :]
                sent.arguments = len(arguments)
                out.tool_calls.append({"index": index, "function": {"arguments": piece}})
        return out

    def _snapshot(self, *, final: bool) -> tuple[str, list[tuple[str | None, str]]]:
        """(content so far, [(name or None while incomplete, argument text so far)])."""
        text, fmt = self.text, self.fmt
        start = text.find(fmt.trigger)
        if start < 0:
            return (text if final else text[: len(text) - _held_back(text, fmt.trigger)]), []
        calls: list[tuple[str | None, str]] = []
        pos = _literal(text, start, fmt.begin)
        while pos is not None:
            pos = _literal(text, pos, fmt.call_open)
            match = None if pos is None else _NAME.match(text, pos)
            if match is None:
                break
            name = json.loads(f'"{match.group(1)}"')
            key = re.compile(rf'\s*,\s*"{re.escape(fmt.args_key)}"\s*:\s*').match(text, match.end())
            if key is None:
                calls.append((name, ""))
                break
            end = _object_end(text, key.end())
            calls.append((name, text[key.end() : end or len(text)]))
            if end is None:
                break
            pos = _literal(text, end, fmt.call_tail())
            pos = None if pos is None else _literal(text, pos, fmt.separator)
        return text[:start], calls


def _held_back(text: str, trigger: str) -> int:
    """Length of the longest tail of `text` that is a proper prefix of `trigger`."""
    for n in range(min(len(trigger) - 1, len(text)), 0, -1):
        if text.endswith(trigger[:n]):
            return n
    return 0


def _literal(text: str, pos: int, literal: str) -> int | None:
    """Position after `literal` (whitespace around it tolerated) or None if it is not (yet) all there."""
    while pos < len(text) and text[pos] in " \t\r\n":
        pos += 1
    core = literal.strip()
    return pos + len(core) if text.startswith(core, pos) else None


def _object_end(text: str, pos: int) -> int | None:
    """End of the JSON value starting at `pos` if it is complete in `text` (strings and escapes respected)."""
    depth, in_string, escaped = 0, False, False
    for i in range(pos, len(text)):
        c = text[i]
        if in_string:
            if escaped:
                escaped = False
            elif c == "\\":
                escaped = True
            elif c == '"':
                in_string = False
        elif c == '"':
            in_string = True
        elif c in "{[":
            depth += 1
        elif c in "}]":
            depth -= 1
            if depth == 0:
                return i + 1
    return None
